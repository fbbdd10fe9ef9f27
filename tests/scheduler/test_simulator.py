"""The simulator's clock and accounting, and the policy ranking it produces: the
benchmark's numbers are only as good as these."""

import statistics

import pytest

from services.common.cost_curve import CostCurve
from services.scheduler.length_model import LengthModel
from services.scheduler.policies import make_policy
from services.scheduler.policies.base import Request
from services.scheduler.simulator import (
    SimStep,
    Simulator,
    SpecConfig,
    synthetic_workload,
)

FLAT_1MS = CostCurve((1.0, 512.0), (1.0, 1.0))  # every forward takes 1 ms, whatever its size


def tiny_step(lengths: list[int], step_id: str = "s", prompt_len: int = 4, n: int | None = None) -> SimStep:
    """One request per length; ``n`` samples per prompt (default: all one prompt's)."""
    n = n or len(lengths)
    requests = [Request(step_id, f"p{i // n}", i % n, prompt_len, max_tokens=100)
                for i in range(len(lengths))]
    return SimStep(step_id, requests, {r.key: n for r, n in zip(requests, lengths)}, {})


def test_clock_on_a_hand_computed_step():
    """One worker, two sequences of 10 and 20 tokens: one prefill forward (1 ms, the
    second prefill rides in the same forward), then one token per 1 ms forward."""
    result = Simulator(make_policy("static"), FLAT_1MS, 1, 2, quantum_s=0.0).run(
        [tiny_step([10, 20])], LengthModel())
    (stats,) = result.steps
    assert stats.makespan_s == pytest.approx(0.021)
    assert stats.tail_time_s == pytest.approx(0.010)
    assert stats.bubble_ratio == pytest.approx(0.0)
    assert result.num_chunks == 2 and result.num_migrations == 0


def test_queued_work_waits_for_a_slot_and_idle_time_is_bubble():
    """Capacity 1, two workers, three prompts of lengths 10, 30, 10 placed round-robin:
    w0 runs 10 then 10, w1 runs 30. Makespan 31 ms (1 prefill + 30); w0 busy 2 x 11 ms."""
    result = Simulator(make_policy("static"), FLAT_1MS, 2, 1, quantum_s=0.0).run(
        [tiny_step([10, 30, 10], n=1)], LengthModel())
    (stats,) = result.steps
    assert stats.makespan_s == pytest.approx(0.031)
    assert stats.worker_busy_s == pytest.approx({"w0": 0.022, "w1": 0.031})
    assert stats.bubble_ratio == pytest.approx((0.062 - 0.031 - 0.022) / 0.062)


def test_migrations_are_counted_and_charged_a_reprefill():
    """Seer with 5-token chunks on two workers: chunks move, each move re-prefills."""
    result = Simulator(make_policy("seer", chunk_size=5), FLAT_1MS, 2, 1, quantum_s=0.0).run(
        [tiny_step([40, 3, 3, 3, 3])], LengthModel())
    assert result.num_chunks > 5
    assert result.steps[0].num_migrations == result.num_migrations
    assert (result.num_migrations > 0) == (result.reprefill_tokens > 0)


def run_mean(policy: str, workload_kw: dict, seeds=range(3), **policy_kw):
    makespans, bubbles = [], []
    for seed in seeds:
        workload = synthetic_workload(128, n=16, num_epochs=4, seed=seed, **workload_kw)
        result = Simulator(make_policy(policy, **policy_kw), CostCurve.h100("7B"), 64, 8).run(
            [workload.step(3)], LengthModel())
        makespans.append(result.steps[0].makespan_s)
        bubbles.append(result.steps[0].bubble_ratio)
        assert result.steps[0].num_samples == 128 * 16
    return statistics.mean(makespans), statistics.mean(bubbles)


def test_history_policies_beat_static_on_a_heavy_tailed_workload():
    """64 workers x 32 samples, lognormal lengths with a heavy tail across prompts:
    placing from history (histopipe) and ours (rhymerl) finish sooner and idle less."""
    static = run_mean("static", {"runaway_prob": 0.0})
    for policy in ("histopipe", "rhymerl"):
        makespan, bubble = run_mean(policy, {"runaway_prob": 0.0})
        assert makespan < 0.95 * static[0], policy
        assert bubble < static[1], policy


def test_rhymerl_beats_static_and_seer_when_runaways_hide_in_short_groups():
    static, seer, ours = (run_mean(p, {"runaway_prob": 0.01}) for p in ("static", "seer", "rhymerl"))
    assert ours[0] < 0.95 * min(static[0], seer[0])
    assert ours[1] < min(static[1], seer[1])


def test_cross_step_overlap_finishes_four_steps_sooner_and_tags_stale_samples():
    workload = synthetic_workload(64, n=16, num_epochs=5, seed=1)
    totals = {}
    for overlap in (False, True):
        steps = [workload.step(e, history_lag=int(overlap)) for e in (1, 2, 3, 4)]
        sim = Simulator(make_policy("rhymerl", cross_step=overlap), CostCurve.h100("7B"), 16, 8,
                        overlap=overlap)
        result = sim.run(steps, LengthModel())
        assert [s.num_samples for s in result.steps] == [64 * 16] * 4
        totals[overlap] = result
    assert totals[True].total_s < 0.9 * totals[False].total_s
    assert totals[False].num_stale_start == totals[False].num_mixed_version == 0
    assert totals[True].num_stale_start > 0


def test_speculation_speeds_up_decoding_and_alpha_round_trips():
    alpha = SpecConfig.alpha_from_mean_accepted(2.5, num_draft=4)
    assert sum(alpha ** i for i in range(5)) == pytest.approx(2.5)
    step = synthetic_workload(16, n=16, num_epochs=1, seed=0).step(0)
    plain = Simulator(make_policy("static"), CostCurve.h100("7B"), 4, 8).run([step], LengthModel())
    step = synthetic_workload(16, n=16, num_epochs=1, seed=0).step(0)
    spec = Simulator(make_policy("static"), CostCurve.h100("7B"), 4, 8, spec=SpecConfig(0.7)).run(
        [step], LengthModel())
    assert spec.total_s < 0.6 * plain.total_s


def test_trace_workload_reads_lengths_by_prompt_and_epoch(tmp_path):
    """Recorded rollouts become per-epoch length lists; epoch e's history is epochs < e."""
    import numpy as np

    from services.common.traces import TraceRecord, write_traces
    from services.scheduler.simulator import trace_workload

    records = [TraceRecord(f"q{p}", epoch, i, epoch, np.arange(3 + p, dtype=np.int32),
                           np.zeros(10 * (p + 1) + epoch + i, dtype=np.int32),
                           np.zeros(10 * (p + 1) + epoch + i, dtype=np.float32), 0.0)
               for epoch in range(3) for p in range(2) for i in range(2)]
    path = tmp_path / "t.npz"
    write_traces(path, records)
    workload = trace_workload([path])
    assert workload.lengths["q1"] == [[20, 21], [21, 22], [22, 23]]
    assert workload.prompt_lens == {"q0": 3, "q1": 4} and workload.max_tokens == 23
    step = workload.step(2)
    assert step.history["q0"] == [[11, 12], [10, 11]]
    assert sorted(step.true_len.values()) == [12, 13, 22, 23]
    assert len(workload.take(5).lengths) == 5  # tiled with renamed copies
    with pytest.raises(ValueError, match="length law"):
        workload.known_law_history(2)


def test_known_law_history_draws_from_the_law_the_samples_came_from():
    """The prediction-limit benchmark's history: fresh draws around each prompt's true
    scale of that epoch (not its earlier epochs'), reproducible, kept by ``take``."""
    import numpy as np

    workload = synthetic_workload(400, n=16, num_epochs=3, seed=5, runaway_prob=0.0, jump_prob=0.5)
    law = workload.law
    history = workload.known_law_history(2, num_samples=64, seed=1)
    assert history == workload.known_law_history(2, num_samples=64, seed=1)
    assert history != workload.known_law_history(2, num_samples=64, seed=2)
    assert set(history) == set(workload.lengths) and all(len(h) == 1 and len(h[0]) == 64 for h in history.values())
    uncapped = [p for p in history if law.scales[p][2] < np.log(workload.max_tokens) - 1.5]
    assert len(uncapped) > 300
    log_median = {p: float(np.median(np.log(history[p][0]))) for p in uncapped}
    # the draws sit on this epoch's scale (sampling error of a median of 64: ~0.08) ...
    errors = [log_median[p] - law.scales[p][2] for p in uncapped]
    assert abs(statistics.mean(errors)) < 0.02 and max(map(abs, errors)) < 0.4
    # ... and so do the epoch's real samples, while half the prompts jumped since epoch 1
    real = [float(np.median(np.log(workload.lengths[p][2]))) - law.scales[p][2] for p in uncapped]
    assert abs(statistics.mean(real)) < 0.05
    assert statistics.mean(abs(law.scales[p][2] - law.scales[p][1]) for p in uncapped) > 0.2
    tiled = workload.take(800)
    assert tiled.law.scales["p3#1"] == law.scales["p3"]
