"""A finished step's summary and metrics, and its rollouts for the history service.

Both are read from the step's log (what the trainer received), so a step resumed after
a scheduler restart counts its replayed samples like the ones generated since.
"""

from __future__ import annotations

import logging
from collections import Counter

from rhymerl.v1 import common_pb2, rollout_pb2

from services.common import metrics
from services.scheduler.step import StepRun
from services.scheduler.timeline import StepStats

log = logging.getLogger(__name__)
FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_ABORT: "abort"}
SPEC_FIELDS = ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens")


def samples_of(run: StepRun) -> list[rollout_pb2.SampleResult]:
    return run.sample_results()


def step_summary(run: StepRun, stats: StepStats, policy: str) -> rollout_pb2.StepSummary:
    """From the counters delivery kept over the published samples (O(1): the log is not
    decoded)."""
    spec = common_pb2.SpecCounters(**dict(zip(SPEC_FIELDS, run.spec)))
    return rollout_pb2.StepSummary(
        step_id=run.step_id, num_samples=run.num_published,
        num_generated_tokens=run.num_generated_tokens,
        makespan_s=stats.makespan_s, bubble_ratio=stats.bubble_ratio, tail_time_s=stats.tail_time_s,
        spec=spec, num_migrations=stats.num_migrations, worker_busy_s=stats.worker_busy_s,
        history_hit_rate=run.history_hit_rate, policy=policy)


def export(summary: rollout_pb2.StepSummary, totals: common_pb2.SpecCounters) -> None:
    """Adds the step's speculation counters to the service's ``totals``; sets the gauges."""
    for name in SPEC_FIELDS:
        setattr(totals, name, getattr(totals, name) + getattr(summary.spec, name))
    metrics.step_makespan_seconds.set(summary.makespan_s)
    metrics.step_makespan_hist.observe(summary.makespan_s)
    metrics.step_bubble_ratio.set(summary.bubble_ratio)
    metrics.step_tail_seconds.set(summary.tail_time_s)
    metrics.step_spec_draft_tokens.set(summary.spec.num_draft_tokens)
    metrics.step_spec_accepted_tokens.set(summary.spec.num_accepted_tokens)
    metrics.steps_total.labels(status="finished").inc()


def count_samples(finish_reasons: list[int]) -> None:
    for reason, num in Counter(FINISH_NAMES.get(r, "abort") for r in finish_reasons).items():
        metrics.samples_total.labels(finish_reason=reason).inc(num)


def history_rows(run: StepRun) -> list[tuple]:
    """The step's finished (not aborted) samples as history's (prompt_id, step_id,
    sample_index, policy_version, token_ids) rows."""
    return [(s.prompt_id, run.step_id, s.sample_index, s.policy_version, s.token_ids)
            for s in samples_of(run) if s.finish_reason != common_pb2.FINISH_REASON_ABORT]


async def record_history(history, step_id: str, rows: list[tuple], breaker) -> None:
    """Writes a step's ``history_rows`` to history: they draft and predict the next
    epoch. A failure costs speed, never a sample. The outcome is reported to ``breaker``
    (the scheduler's ``HistoryBreaker``: it logs one WARNING per outage; a write that
    history never answered opens it)."""
    try:
        await history.put_rollouts(rows)
    except Exception as exc:  # noqa: BLE001 - the trainer still gets its samples
        breaker.failed(exc, "write")
        log.debug("could not record step %s in history: %s", step_id, exc)
    else:
        breaker.answered()
