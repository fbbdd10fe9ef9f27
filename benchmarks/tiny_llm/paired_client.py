"""Two rollout systems behind one client: every call the trainer makes goes to both.

The example GRPO trainer sees one `rhymerl.RolloutClient` surface (rollout /
report_rewards / push_weights) and learns from the first system's samples; the second gets
the same step ids, prompts, sampling and seeds, and the same weights after every update,
so both sample every epoch from the same policy. Each rollout is timed on its own (the
systems never run at the same time; which goes first alternates by epoch, so a slowly
changing machine load favours neither) and compared sample by sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rhymerl import Prompt, SamplingParams, StepResult


@dataclass
class TimedStep:
    """One system's rollout of one epoch."""

    result: StepResult
    wall_s: float  # the rollout call, as the trainer waits for it

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.result.samples)

    @property
    def num_aborted(self) -> int:
        return sum(s.finish_reason == "abort" for s in self.result.samples)


@dataclass
class PairedClient:
    """`reference` serves the trainer; `candidate` is measured beside it."""

    reference: object  # a RolloutClient
    candidate: object
    recorded_prompts: dict[str, list[int]] | None = None  # prompt id -> token ids the prompt set must match
    on_epoch: object = None  # called with (epoch, reference TimedStep, candidate TimedStep)
    epochs: list[tuple[TimedStep, TimedStep]] = field(default_factory=list)

    def rollout(self, step_id: str, prompts: list[Prompt], n: int, sampling: SamplingParams,
                policy_version: int = 0) -> StepResult:
        if self.recorded_prompts is not None:
            self._check_prompts(prompts)
        epoch = len(self.epochs)
        order = [("reference", self.reference), ("candidate", self.candidate)]
        timed = {}
        for name, client in order if epoch % 2 == 0 else order[::-1]:
            start = time.perf_counter()
            result = client.rollout(step_id, prompts, n, sampling, policy_version=policy_version)
            timed[name] = TimedStep(result, time.perf_counter() - start)
        self.epochs.append((timed["reference"], timed["candidate"]))
        if self.on_epoch is not None:
            self.on_epoch(epoch, timed["reference"], timed["candidate"])
        return timed["reference"].result

    def report_rewards(self, step_id: str, rewards: list[tuple[str, int, float]]) -> int:
        self.candidate.report_rewards(step_id, rewards)
        return self.reference.report_rewards(step_id, rewards)

    def push_weights(self, version: int, data: bytes) -> int:
        self.candidate.push_weights(version, data)
        return self.reference.push_weights(version, data)

    def _check_prompts(self, prompts: list[Prompt]) -> None:
        for p in prompts:
            if list(p.token_ids) != self.recorded_prompts.get(p.prompt_id):
                raise ValueError(f"prompt {p.prompt_id!r} is not the recorded prompt set's (other tokenizer "
                                 f"or task version?)")


def identical_share(a: StepResult, b: StepResult) -> float:
    """Share of (prompt, sample index) whose responses are the same token for token."""
    theirs = {s.key: s.token_ids for s in b.samples}
    return sum(theirs.get(s.key) == s.token_ids for s in a.samples) / max(1, len(a.samples))
