"""How far a trainer's recomputed logprobs are from the rollout's, measured live.

The trainer reports, for some or all of a finished step's samples, its own logprob of
every generated token (ReportLogprobs). Per token, d = rollout logprob - trainer logprob;
a step's figures are the mean and max of |d|, the mean of d (the k1 estimate of
KL(rollout || trainer)), the mean of exp(-d) - 1 + d (the k3 estimate: unbiased, >= 0,
and 0 exactly when every token matches) and how many tokens match to the last bit.
The tokens were sampled from the rollout policy, which is what makes these per-token
averages estimates of the KL between the two.

Each (step, sample) keeps only its sums (re-reporting a sample replaces them); the
Prometheus histograms see each sample once. Steps are forgotten with the scheduler's
in-memory ones (max_steps_retained). This module knows nothing about gRPC transport or placement.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rhymerl.v1 import rollout_pb2

from services.common import metrics
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound

if TYPE_CHECKING:
    import numpy as np

# A logprob is <= 0. A trainer's float32 log-softmax of a token of probability ~1 may
# round to a hair above 0 (a few ulps of its logits' size: ~1e-5 for logits of ~50);
# more than this is no logprob (a probability, a logit, a sign slip) and is refused.
MAX_LOGPROB = 1e-3


@dataclass(frozen=True)
class SampleMismatch:
    """The sums of one sample's per-token comparison."""

    num_tokens: int
    num_identical: int
    sum_abs_diff: float
    max_abs_diff: float
    sum_diff: float
    sum_kl: float

    @classmethod
    def compare(cls, rollout: np.ndarray, trainer: np.ndarray) -> tuple["SampleMismatch", np.ndarray]:
        """Both [num_tokens] float32. Returns the sums and |d| per token."""
        import numpy as np  # loaded on the first report: a scheduler that gets none never loads it (~12 MB)

        d = rollout.astype(np.float64) - trainer.astype(np.float64)  # [num_tokens]
        abs_diff = np.abs(d)
        kl = np.expm1(-d) + d  # exp(-d) - 1 + d, accurate for tiny d
        identical = int(np.count_nonzero(rollout.view(np.int32) == trainer.view(np.int32)))
        return cls(len(d), identical, float(abs_diff.sum()), float(abs_diff.max(initial=0.0)), float(d.sum()),
                   float(kl.sum())), abs_diff


def summarize(parts) -> rollout_pb2.MismatchStats:
    parts = list(parts)
    num_tokens = sum(p.num_tokens for p in parts)
    mean = (lambda total: total / num_tokens) if num_tokens else (lambda total: 0.0)
    return rollout_pb2.MismatchStats(
        num_samples=len(parts), num_tokens=num_tokens, num_identical_tokens=sum(p.num_identical for p in parts),
        mean_abs_diff=mean(sum(p.sum_abs_diff for p in parts)), max_abs_diff=max((p.max_abs_diff for p in parts),
                                                                                 default=0.0),
        mean_log_ratio=mean(sum(p.sum_diff for p in parts)), kl=mean(sum(p.sum_kl for p in parts)))


def checked_logprobs(reported: rollout_pb2.SampleLogprobs, num_tokens: int, field: str) -> np.ndarray:
    """The trainer's logprobs of one sample (``field``, e.g. samples[3]) as float32: one per
    token of the rollout's sample (``num_tokens``), each finite and at most MAX_LOGPROB;
    else InvalidArgument naming the field (the step router checks a report with it too)."""
    import numpy as np

    trainer = np.asarray(reported.logprobs, dtype=np.float32)
    if len(trainer) != num_tokens:
        raise InvalidArgument(f"{len(trainer)} logprobs for a sample of {num_tokens} tokens", f"{field}.logprobs")
    if not np.isfinite(trainer).all():
        j = int(np.flatnonzero(~np.isfinite(trainer))[0])
        raise InvalidArgument(f"logprobs must be finite, got {trainer[j]}", f"{field}.logprobs[{j}]")
    if (trainer > MAX_LOGPROB).any():
        j = int(np.flatnonzero(trainer > MAX_LOGPROB)[0])
        raise InvalidArgument(f"a logprob is at most 0 (up to {MAX_LOGPROB:g} of rounding), got "
                              f"{float(trainer[j]):g}", f"{field}.logprobs[{j}]")
    return trainer


def checked_report(request: rollout_pb2.ReportLogprobsRequest, logprobs_on: bool, finished: Mapping, has_sample,
                   step_id: str) -> list[tuple[tuple[str, int], object, np.ndarray]]:
    """A logprobs report checked whole, in the trainer's numbering (samples[i]): per
    reported sample (key, the step's finished sample, the trainer's logprobs), or the first
    error: logprobs off, a negative index, a sample the step does not have (NotFound), one
    reported twice, one not finished (``finished``: key -> a sample with ``logprobs``;
    ``has_sample(prompt_id, index)``: whether the step has it at all). The scheduler and
    the step router (before any shard sees a report) check with it alike."""
    if not logprobs_on:
        raise FailedPrecondition("the step was sampled with logprobs off: nothing to compare with", "step_id")
    out, seen = [], set()
    for i, reported in enumerate(request.samples):
        field, key = f"samples[{i}]", (reported.prompt_id, reported.sample_index)
        if reported.sample_index < 0:  # as ReportRewards: malformed, not a sample that is missing
            raise InvalidArgument(f"must be >= 0, got {reported.sample_index}", f"{field}.sample_index")
        sample = finished.get(key)
        if sample is None and not has_sample(*key):
            raise NotFound(f"no sample {key} in step {step_id!r}", field)
        if key in seen:
            raise InvalidArgument(f"sample {key} is reported twice", field)
        seen.add(key)
        if sample is None:
            raise FailedPrecondition(f"sample {key} has not finished", field)
        out.append((key, sample, checked_logprobs(reported, len(sample.logprobs), field)))
    return out


class MismatchTracker:
    """Args:
        steps: the scheduler's steps by id (read only: the samples to compare with).
    """

    def __init__(self, steps: Mapping):
        self.steps = steps
        self._reports: dict[str, dict[tuple[str, int], SampleMismatch]] = {}  # step id -> sample -> sums

    def report(self, request: rollout_pb2.ReportLogprobsRequest) -> rollout_pb2.ReportLogprobsResponse:
        """Checks the whole report first (nothing is recorded from a rejected one), then
        records it, exports it and returns the step's and this report's figures."""
        compared = self._compare(request)
        for step_id in [s for s in self._reports if s not in self.steps]:
            del self._reports[step_id]  # the scheduler forgot the step
        recorded = self._reports.setdefault(request.step_id, {})
        for key, part, abs_diff in compared:
            if key not in recorded:  # the histograms count each sample once
                metrics.logprob_abs_diff.observe_many(abs_diff)
                metrics.logprob_kl.observe_many([part.sum_kl / part.num_tokens] if part.num_tokens else [])
            recorded[key] = part
        step = summarize(recorded.values())
        metrics.step_logprob_abs_diff.set(step.mean_abs_diff)
        metrics.step_logprob_kl.set(step.kl)
        return rollout_pb2.ReportLogprobsResponse(step=step, reported=summarize(p for _, p, _ in compared))

    def _compare(self, request) -> list[tuple[tuple[str, int], SampleMismatch, np.ndarray]]:
        import numpy as np

        if not request.step_id:
            raise InvalidArgument("must be non-empty", "step_id")
        run = self.steps.get(request.step_id)
        if run is None:
            raise NotFound(f"no step {request.step_id!r} (unknown, or no longer retained)", "step_id")
        # The finished samples are the step's published results (its progress is released).
        finished = {(s.prompt_id, s.sample_index): s for s in run.sample_results()} if run.sampling.logprobs else {}
        out = []
        for key, sample, trainer in checked_report(request, run.sampling.logprobs, finished, run.has_sample,
                                                   request.step_id):
            part, abs_diff = SampleMismatch.compare(np.asarray(sample.logprobs, dtype=np.float32), trainer)
            out.append((key, part, abs_diff))
        return out
