"""rhymerl SDK: submit RL rollout steps to a rhymerl scheduler over gRPC (no torch needed)."""

from rhymerl.aio import AsyncRolloutClient, AsyncStepStream
from rhymerl.client import RolloutClient, StepStream
from rhymerl.types import Mismatch, Prompt, Sample, SamplingParams, ServiceStats, StepResult, StepSummary

__all__ = ["AsyncRolloutClient", "AsyncStepStream", "Mismatch", "Prompt", "RolloutClient", "Sample",
           "SamplingParams", "ServiceStats", "StepResult", "StepStream", "StepSummary"]
