"""The rollout worker's engine: continuous batching, paged KV cache, batched lossless
speculative verification, chunked execution. ``LLMEngine`` is the entry point."""

from services.rollout.engine.cost_model import CostModel
from services.rollout.engine.drafter_protocol import Drafter
from services.rollout.engine.engine import LLMEngine, run_to_completion
from services.rollout.engine.request import EngineRequest, RequestOutput

__all__ = ["CostModel", "Drafter", "EngineRequest", "LLMEngine", "RequestOutput", "run_to_completion"]
