"""The trainer/rollout logprob mismatch: figures against hand-computed values, replace
semantics, histograms that count each sample once, and a clear error (naming the field)
for every bad report, with nothing recorded from a rejected one.

If these fail, the mismatch a trainer reads (and the dashboard plots) is not the
difference between its logprobs and the rollout's."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import REGISTRY
from rhymerl.v1 import common_pb2, rollout_pb2

from services.common import packed
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.scheduler.mismatch import MismatchTracker
from services.scheduler.policies.base import Request
from services.scheduler.step import SampleProgress, StepRun

ROLLOUT = {("p0", 0): [-0.5, -1.25, -3.0], ("p0", 1): [-0.125, -2.0], ("p1", 0): [-0.75]}


def step(step_id: str, logprobs: bool = True, unfinished=()) -> StepRun:
    samples = []
    for (pid, k), lps in ROLLOUT.items():
        r = Request(step_id, pid, k, prompt_len=3, max_tokens=8)
        samples.append(SampleProgress(r, b"", packed.varint(1), token_ids=packed.pack_token_ids(range(len(lps))),
                                      num_tokens=len(lps), logprobs=packed.pack_logprobs(lps) if logprobs else b""))
    request = rollout_pb2.SubmitStepRequest(step_id=step_id, n=2,
                                            sampling=common_pb2.SamplingParams(logprobs=logprobs, max_tokens=8))
    run = StepRun(request, samples)
    for prog in samples:  # finished: published, as the scheduler does
        if (prog.request.prompt_id, prog.request.sample_index) not in unfinished:
            prog.done = True
            run.record([packed.field(1, run.encode_sample(prog, 0))])  # as delivery records it
    return run


def report(step_id: str, samples: dict) -> rollout_pb2.ReportLogprobsRequest:
    return rollout_pb2.ReportLogprobsRequest(step_id=step_id, samples=[
        rollout_pb2.SampleLogprobs(prompt_id=p, sample_index=k, logprobs=lps) for (p, k), lps in samples.items()])


def histogram_count(name: str) -> float:
    return REGISTRY.get_sample_value(f"rhymerl:{name}_count") or 0.0


def test_identical_logprobs_mismatch_nothing():
    tracker = MismatchTracker({"s": step("s")})
    out = tracker.report(report("s", ROLLOUT))
    assert out.step.num_samples == 3 and out.step.num_tokens == 6 and out.step.num_identical_tokens == 6
    assert out.step.mean_abs_diff == out.step.max_abs_diff == out.step.kl == out.step.mean_log_ratio == 0.0


def test_figures_of_a_known_shift():
    """Trainer = rollout + 0.01 on every token: |d| = 0.01, d = -0.01, k3 = e^0.01 - 1.01."""
    tracker = MismatchTracker({"s": step("s")})
    shifted = {k: list(np.float32(v) + np.float32(0.01)) for k, v in ROLLOUT.items()}
    m = tracker.report(report("s", shifted)).step
    d = [float(np.float32(x)) - float(np.float32(x) + np.float32(0.01)) for v in ROLLOUT.values() for x in v]
    assert m.num_identical_tokens == 0
    assert m.mean_abs_diff == pytest.approx(sum(abs(x) for x in d) / 6, rel=1e-12)
    assert m.max_abs_diff == pytest.approx(max(abs(x) for x in d), rel=1e-12)
    assert m.mean_log_ratio == pytest.approx(sum(d) / 6, rel=1e-12)
    assert m.kl == pytest.approx(sum(math.expm1(-x) + x for x in d) / 6, rel=1e-9)
    assert m.kl == pytest.approx(math.exp(0.01) - 1.01, rel=1e-3)


def test_re_reporting_replaces_and_histograms_count_each_sample_once():
    tracker = MismatchTracker({"s": step("s")})
    tokens_before, samples_before = histogram_count("trainer_logprob_abs_diff"), histogram_count("trainer_logprob_kl")
    first = tracker.report(report("s", {("p0", 0): [-0.5, -1.0, -3.0]}))
    assert first.step.num_samples == 1 and first.step.max_abs_diff == pytest.approx(0.25)
    second = tracker.report(report("s", {("p0", 0): ROLLOUT[("p0", 0)], ("p1", 0): [-0.5]}))
    assert second.reported.num_samples == 2 and second.step.num_samples == 2 and second.step.num_tokens == 4
    assert second.step.max_abs_diff == pytest.approx(0.25)  # only p1's 0.25 now: p0 was replaced
    assert second.step.num_identical_tokens == 3
    assert histogram_count("trainer_logprob_abs_diff") - tokens_before == 4  # p0's 3 tokens once, p1's 1
    assert histogram_count("trainer_logprob_kl") - samples_before == 2
    assert REGISTRY.get_sample_value("rhymerl:step_trainer_logprob_abs_diff") == pytest.approx(0.25 / 4)


@pytest.mark.parametrize("bad,error,field", [
    (report("", {}), InvalidArgument, "step_id"),
    (report("nope", {}), NotFound, "step_id"),
    (report("s", {("p9", 0): [-1.0]}), NotFound, "samples[0]"),
    (report("s", {("p0", -1): [-1.0]}), InvalidArgument, "samples[0].sample_index"),  # as ReportRewards
    (report("s", {("p0", 1): [-1.0]}), InvalidArgument, "samples[0].logprobs"),
    (report("s", {("p1", 0): [float("nan")]}), InvalidArgument, "samples[0].logprobs[0]"),
    (report("s", {("p1", 0): [float("-inf")]}), InvalidArgument, "samples[0].logprobs[0]"),
    (report("s", {("p1", 0): [-0.75], ("p0", 0): [-0.5, -1.25, 3.0]}), InvalidArgument, "samples[1].logprobs[2]"),
    (report("s", {("p0", 1): [0.01, -2.0]}), InvalidArgument, "samples[0].logprobs[0]"),  # no logprob > 0
    (report("s", {("p0", 1): [-1.0, -1.0], ("p1", 2): [-1.0]}), NotFound, "samples[1]"),
    (report("open", {("p0", 1): [-1.0, -2.0]}), FailedPrecondition, "samples[0]"),
    (report("off", {("p1", 0): [-1.0]}), FailedPrecondition, "step_id"),
])
def test_bad_reports_are_rejected_naming_the_field_and_record_nothing(bad, error, field):
    steps = {"s": step("s"), "open": step("open", unfinished={("p0", 1)}), "off": step("off", logprobs=False)}
    tracker = MismatchTracker(steps)
    with pytest.raises(error) as err:
        tracker.report(bad)
    assert err.value.field == field
    assert tracker.report(report("s", {("p1", 0): [-0.75]})).step.num_samples == 1  # nothing else recorded


def test_a_logprob_a_hair_above_zero_is_rounding_and_taken():
    """A token of probability ~1: a trainer's float32 log-softmax may give +1e-6, not a
    bad report (anything above MAX_LOGPROB is)."""
    tracker = MismatchTracker({"s": step("s")})
    out = tracker.report(report("s", {("p0", 1): [1e-6, 0.0]}))
    assert out.reported.num_tokens == 2 and out.reported.max_abs_diff == pytest.approx(2.0)


def test_a_sample_reported_twice_in_one_call_is_rejected():
    tracker = MismatchTracker({"s": step("s")})
    bad = report("s", {("p1", 0): [-0.75]})
    bad.samples.append(bad.samples[0])
    with pytest.raises(InvalidArgument) as err:
        tracker.report(bad)
    assert err.value.field == "samples[1]"


def test_steps_the_scheduler_forgot_are_forgotten():
    steps = {"a": step("a"), "b": step("b")}
    tracker = MismatchTracker(steps)
    tracker.report(report("a", ROLLOUT))
    del steps["a"]
    tracker.report(report("b", ROLLOUT))
    assert set(tracker._reports) == {"b"}
