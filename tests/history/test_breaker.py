"""HistoryBreaker: the reads a step waits for get a short deadline, and after one timed
out they are skipped (no call) for a backoff that doubles up to a cap while history
hangs; a probe that answers closes it. The backoff runs on a fake clock; only the
deadlines themselves are real (short) waits."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest

from services.history.breaker import HistoryBreaker, HistorySkipped, HistoryTimeout
from services.history.client import HistoryClient
from tests.aio import run_async
from tests.history.hanging import hanging_history

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Calls:
    """A history call that answers, hangs or fails as told; counts the calls made."""

    def __init__(self):
        self.num = 0
        self.mode = "answer"

    async def __call__(self):
        self.num += 1
        if self.mode == "hang":
            await asyncio.Event().wait()
        if self.mode == "fail":
            raise ConnectionError("connection refused")
        return "answer"


def breaker(clock, timeout_s=0.05, **kw) -> HistoryBreaker:
    return HistoryBreaker(timeout_s, first_backoff_s=5.0, max_backoff_s=20.0, clock=clock, **kw)


@run_async
async def test_reads_that_answer_pass_through_and_keep_it_closed():
    clock, call = Clock(), Calls()
    b = breaker(clock)
    assert [await b.read(call) for _ in range(3)] == ["answer"] * 3
    assert call.num == 3 and not b.is_open and b.num_timeouts == 0


@run_async
async def test_after_a_timeout_reads_are_skipped_without_a_call_then_probed_with_a_growing_backoff():
    clock, call = Clock(), Calls()
    b = breaker(clock)
    call.mode = "hang"
    with pytest.raises(HistoryTimeout):
        await b.read(call)
    assert b.is_open and b.backoff_s == 5.0 and call.num == 1
    for _ in range(10):  # the backoff runs: no call made, at once
        with pytest.raises(HistorySkipped):
            await b.read(call)
    assert call.num == 1 and b.num_skipped == 10

    clock.t += 5.0  # backoff over: one probe; it times out, the backoff doubles
    with pytest.raises(HistoryTimeout):
        await b.read(call)
    assert call.num == 2 and b.backoff_s == 10.0
    clock.t += 9.0
    with pytest.raises(HistorySkipped):
        await b.read(call)
    clock.t += 1.0
    with pytest.raises(HistoryTimeout):
        await b.read(call)
    assert call.num == 3 and b.backoff_s == 20.0
    clock.t += 20.0
    with pytest.raises(HistoryTimeout):
        await b.read(call)
    assert b.backoff_s == 20.0  # the cap

    call.mode = "answer"  # history is back: the next probe answers and closes it
    clock.t += 20.0
    assert await b.read(call) == "answer"
    assert not b.is_open and b.backoff_s == 0.0
    assert await b.read(call) == "answer" and call.num == 6
    call.mode = "hang"  # a new outage starts from the first backoff again
    with pytest.raises(HistoryTimeout):
        await b.read(call)
    assert b.backoff_s == 5.0


@run_async
async def test_one_probe_at_a_time_the_others_skipped_meanwhile():
    clock, call = Clock(), Calls()
    b = breaker(clock, timeout_s=30.0)  # the probe is cancelled long before its deadline
    call.mode = "hang"
    b.failed(TimeoutError(), "read")  # as if a read had timed out
    clock.t += 5.0
    probe = asyncio.create_task(b.read(call))
    while call.num < 1:
        await asyncio.sleep(0)
    assert b.is_open  # the probe is in flight
    with pytest.raises(HistorySkipped):
        await b.read(call)
    assert call.num == 1
    probe.cancel()  # a cancelled probe (its caller gone) leaves the next read free to probe
    with pytest.raises(asyncio.CancelledError):
        await probe
    assert not b.is_open
    call.mode = "answer"
    assert await b.read(call) == "answer"


@run_async
async def test_other_failures_open_nothing_and_an_outage_logs_one_warning(caplog):
    clock, call = Clock(), Calls()
    b = breaker(clock)
    caplog.set_level(logging.DEBUG, logger="services.history.breaker")
    call.mode = "fail"  # a dead history fails fast: nothing to skip
    for _ in range(3):
        with pytest.raises(ConnectionError):
            await b.read(call)
    assert call.num == 3 and not b.is_open
    call.mode = "hang"
    for _ in range(3):
        with pytest.raises((HistoryTimeout, HistorySkipped)):
            await b.read(call)
    b.failed(TimeoutError(), "write")  # a write's timeout opens it too (doubling its backoff)
    assert b.backoff_s == 10.0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "connection refused" in warnings[0].getMessage()
    b.answered()  # a write that answers closes it
    assert not b.is_open
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "answers again" in infos[0] and "2 reads skipped" in infos[0]


def test_grpc_deadline_exceeded_counts_as_a_timeout():
    clock = Clock()
    b = breaker(clock)
    err = grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               "Deadline Exceeded")
    b.failed(err, "write")
    assert b.is_open and b.num_timeouts == 1
    unavailable = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "connection refused")
    b2 = breaker(clock)
    b2.failed(unavailable, "read")
    assert not b2.is_open and b2.num_timeouts == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        HistoryBreaker(0)
    with pytest.raises(ValueError):
        HistoryBreaker(1.0, first_backoff_s=10.0, max_backoff_s=5.0)


@run_async
async def test_a_hung_history_service_over_grpc_costs_one_deadline_then_nothing():
    """A real gRPC server that takes the calls and never answers (a SIGSTOPped history
    as its clients see it): the first read ends at the breaker's deadline, not the
    client's 30 s; the next ones are skipped without reaching the server."""
    async with hanging_history() as (address, servicer), HistoryClient(address) as client:
        b = HistoryBreaker(0.5, name="test")
        started = time.monotonic()
        with pytest.raises(HistoryTimeout):
            await b.read(lambda: client.get_history(["p"], max_epochs=4, include_tokens=False))
        with pytest.raises(HistorySkipped):
            await b.read(lambda: client.get_recent_responses(16, 1024))
        assert time.monotonic() - started < 15.0  # 0.5 s of deadline; generous for a busy machine
        # (on a busy machine the first call may not even have reached the server in 0.5 s)
        assert servicer.calls["GetHistory"] <= 1 and servicer.calls["GetRecentResponses"] == 0
        assert b.num_calls == 1 and b.num_skipped == 1
