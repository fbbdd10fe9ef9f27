"""One submitted step: its samples' progress and the append-only log of its events.

The log is what makes SubmitStep idempotent: a re-submission (a trainer's
retry) replays the log from the start and then follows it live, so every
(prompt, sample) is delivered exactly once per stream and never generated twice.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from rhymerl.v1 import common_pb2, rollout_pb2

from services.scheduler.policies.base import Request


def fingerprint(request: rollout_pb2.SubmitStepRequest) -> str:
    """Content hash of a step request (deterministic serialization)."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()


@dataclass
class SampleProgress:
    """Tokens and counters of one sample, accumulated over its chunks."""

    request: Request
    prompt_token_ids: list[int]
    seed: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    done: bool = False
    num_failures: int = 0  # Run calls that failed while it was in them
    error: str = ""  # why the service gave it up (finish reason ABORT)


class StepRun:
    """State of one step; the dispatcher fills it, SubmitStep streams read it."""

    def __init__(self, request: rollout_pb2.SubmitStepRequest, samples: list[SampleProgress]):
        self.step_id = request.step_id
        self.fingerprint = fingerprint(request)
        self.request = request
        self.sampling = request.sampling
        self.samples = {s.request.request_id: s for s in samples}
        self.num_done = 0
        self.events: list[rollout_pb2.StepEvent] = []
        self.finished = asyncio.Event()
        self._changed = asyncio.Condition()
        self.history_hit_rate = 0.0
        self.cancelled = False

    fingerprint_of = staticmethod(fingerprint)

    @property
    def is_finished(self) -> bool:
        return self.finished.is_set()

    async def publish(self, event: rollout_pb2.StepEvent, last: bool = False) -> None:
        async with self._changed:
            self.events.append(event)
            if last:
                self.finished.set()
            self._changed.notify_all()

    async def follow(self) -> AsyncIterator[rollout_pb2.StepEvent]:
        """Every event from the first, then live ones until the summary."""
        i = 0
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: i < len(self.events))
                batch = self.events[i:]
            for event in batch:
                yield event
            i += len(batch)
            if self.is_finished and i == len(self.events):
                return

    def sample_result(self, s: SampleProgress, policy_version: int) -> rollout_pb2.SampleResult:
        versions = s.token_versions
        mixed = bool(versions) and any(v != versions[0] for v in versions)
        return rollout_pb2.SampleResult(
            step_id=self.step_id, prompt_id=s.request.prompt_id, sample_index=s.request.sample_index,
            token_ids=s.token_ids, logprobs=s.logprobs if self.sampling.logprobs else [],
            finish_reason=s.finish_reason,
            policy_version=min(versions) if versions else policy_version,
            token_policy_versions=versions if mixed else [],
            spec=common_pb2.SpecCounters(num_verify_steps=s.num_verify_steps,
                                         num_draft_tokens=s.num_draft_tokens,
                                         num_accepted_tokens=s.num_accepted_tokens),
            num_migrations=s.request.num_migrations, seed=s.seed, error=s.error)
