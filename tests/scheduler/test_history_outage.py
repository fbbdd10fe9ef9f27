"""A hung or slow history costs a step at most a short, bounded delay: the length lookup
has a deadline (``CoreLimits.history_timeout_s``) and is skipped while the breaker is
open, and the write at step close holds the summary at most that deadline (not at all
while history hangs), going on behind it. A healthy history is written before the
summary goes out, as before."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from services.history.client import HistoryClient
from services.scheduler.delivery import MAX_PENDING_WRITES
from tests.aio import run_async
from tests.history.hanging import hanging_history
from tests.scheduler.fake_workers import FakeLink, collect, expected_tokens, make_core, step

pytestmark = pytest.mark.timeout(120)
PROMPTS = {"a": [3, 4, 5], "b": [6, 7], "c": [8, 9, 10, 11]}
BOUND_S = 15.0  # a step's wall time with a 0.2-0.5 s deadline, generous for a busy 2-core machine (was 30-60 s)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeHistory:
    """Stores lengths per prompt; reads and writes answer, hang or wait for a gate."""

    def __init__(self, reads: str = "answer", writes: str = "answer"):
        self.read_mode, self.write_mode = reads, writes
        self.gate = asyncio.Event()
        self.num_reads = 0
        self.written: list[list[tuple]] = []
        self.lengths: dict[str, list[int]] = {}

    async def get_history(self, prompt_ids, max_epochs=0, include_tokens=True):
        self.num_reads += 1
        if self.read_mode == "hang":
            await asyncio.Event().wait()
        return {p: [SimpleNamespace(lengths=self.lengths[p])] if p in self.lengths else [] for p in prompt_ids}

    async def put_rollouts(self, rows):
        rows = list(rows)
        if self.write_mode == "hang":
            await asyncio.Event().wait()
        if self.write_mode == "gate":
            await self.gate.wait()
        self.written.append(rows)
        for prompt_id, _, _, _, tokens in rows:
            self.lengths.setdefault(prompt_id, []).append(len(tokens))
        return len(rows)


def tokens(samples) -> dict:
    return {(s.prompt_id, s.sample_index): list(s.token_ids) for s in samples}


async def timed_step(core, step_id: str):
    started = time.monotonic()
    samples, summary = await collect(await core.submit(step(step_id, PROMPTS, n=2)))
    return samples, summary, time.monotonic() - started


@run_async
async def test_a_hung_history_costs_one_deadline_then_steps_skip_it_until_a_probe():
    link = FakeLink()
    core = make_core(link, history_timeout_s=0.2)
    core.history = history = FakeHistory(reads="hang", writes="hang")
    core.history_reads.clock = clock = Clock()
    reference = make_core(FakeLink())  # no history at all

    want, _ = await collect(await reference.submit(step("s0", PROMPTS, n=2)))
    samples, summary, took = await timed_step(core, "s0")
    assert tokens(samples) == tokens(want) and all(list(s.token_ids) == expected_tokens(s, 20) for s in samples)
    assert summary.num_samples == 6 and summary.history_hit_rate == 0.0
    assert took < BOUND_S and history.num_reads == 1 and core.history_reads.is_open
    assert len(core.delivery.history_writes) == 1  # the hung write goes on behind the summary

    for i in (1, 2):  # the breaker is open: no lookup, no wait for the write
        samples, summary, took = await timed_step(core, f"s{i}")
        assert tokens(samples) == tokens(want) and took < BOUND_S
    assert history.num_reads == 1 and core.history_reads.num_skipped == 2

    clock.t += core.history_reads.backoff_s  # the backoff is over: the next step probes (and times out)
    await timed_step(core, "s3")
    assert history.num_reads == 2 and core.history_reads.backoff_s == 2 * core.history_reads.first_backoff_s

    for i in range(4, 4 + MAX_PENDING_WRITES):  # writes still hung behind closed steps stay bounded
        await timed_step(core, f"s{i}")
    assert len(core.delivery.history_writes) == MAX_PENDING_WRITES
    assert core.delivery.num_history_writes_dropped == 4
    await core.stop()  # ends the writes still waiting
    assert not core.delivery.history_writes
    await reference.stop()


@run_async
async def test_a_healthy_history_is_written_before_the_summary_arrives_and_read_by_the_next_step():
    core = make_core(FakeLink(), history_timeout_s=0.5)
    core.history = history = FakeHistory()
    samples, summary = await collect(await core.submit(step("e1", PROMPTS, n=2)))
    assert summary.history_hit_rate == 0.0
    assert len(history.written) == 1 and sorted((r[0], r[2]) for r in history.written[0]) == sorted(tokens(samples))
    _, summary = await collect(await core.submit(step("e2", PROMPTS, n=2)))
    assert summary.history_hit_rate == 1.0 and history.num_reads == 2 and not core.history_reads.is_open
    await core.stop()


@run_async
async def test_a_slow_write_holds_the_summary_at_most_the_deadline_and_still_lands():
    core = make_core(FakeLink(), history_timeout_s=0.2)
    core.history = history = FakeHistory(writes="gate")
    samples, summary, took = await timed_step(core, "slow")
    assert summary.num_samples == 6 and took < BOUND_S
    assert history.written == [] and len(core.delivery.history_writes) == 1
    assert not core.history_reads.is_open  # slow is not hung: the next lookup still asks
    history.gate.set()
    await asyncio.gather(*core.delivery.history_writes)
    assert len(history.written) == 1 and len(history.written[0]) == 6
    await core.stop()


@run_async
async def test_a_hung_history_service_over_grpc_holds_a_step_one_deadline():
    """The scheduler's real client against a gRPC server that takes calls and never
    answers: the step ends after about one deadline (0.5 s), not the client's 30 s."""
    async with hanging_history() as (address, servicer):
        client = HistoryClient(address)
        core = make_core(FakeLink(), history_timeout_s=0.5)
        core.history = client
        try:
            samples, summary, took = await timed_step(core, "g1")
            assert summary.num_samples == 6 and all(list(s.token_ids) == expected_tokens(s, 20) for s in samples)
            assert took < BOUND_S
            assert core.history_reads.num_timeouts == 1 and core.history_reads.is_open
            _, _, took = await timed_step(core, "g2")  # skipped: no new call reaches the server
            assert took < BOUND_S and core.history_reads.num_calls == 1
            assert servicer.calls["GetHistory"] <= 1
        finally:
            await core.stop()
            await client.close()


def test_the_deadline_is_a_bounded_setting_of_both_services():
    from pydantic import ValidationError

    from services.rollout.settings import WorkerSettings
    from services.scheduler.core import CoreLimits
    from services.scheduler.settings import SchedulerSettings

    assert SchedulerSettings().history_timeout_s == CoreLimits().history_timeout_s
    for cls in (SchedulerSettings, WorkerSettings):
        assert cls(history_timeout_s=0.5).history_timeout_s == 0.5
        for bad in (0, 31):
            with pytest.raises(ValidationError):
                cls(history_timeout_s=bad)


@run_async
async def test_the_scheduler_reads_history_with_its_setting():
    """RHYMERL_SCHEDULER_HISTORY_TIMEOUT_S reaches the core's breaker (start_scheduler)."""
    from services.scheduler.server import start_scheduler
    from services.scheduler.settings import SchedulerSettings

    async with hanging_history() as (address, _):
        server, _, stop = await start_scheduler(SchedulerSettings(
            host="127.0.0.1", port=0, metrics_port=0, health_port=0, history_address=address,
            history_timeout_s=0.3))
        try:
            assert server.core.history_reads.timeout_s == 0.3
        finally:
            await stop()
