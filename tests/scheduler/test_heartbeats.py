"""One heartbeat per worker, O(1) each: the worker table's order and counts, the
watchdog's verdicts on silent workers, draining beats, and a worker adopting the
interval its scheduler names."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque

import grpc
from rhymerl.v1 import worker_pb2, worker_pb2_grpc

from services.common import metrics
from services.rollout.registration import keep_registered
from services.rollout.settings import WorkerSettings
from services.scheduler.watchdog import MIN_SHARE, MISSED_BEATS, Watchdog
from services.scheduler.weight_fanout import WeightFanout
from services.scheduler.workers import WorkerTable
from tests.aio import run_async
from tests.scheduler.fake_workers import FakeLink, collect, dispatch_pass, make_core, step


def _gauge(healthy: str) -> float:
    return metrics.workers_registered.labels(healthy=healthy)._value.get()


def test_the_tables_counts_follow_every_change():
    """Readiness and the metrics read counts the table keeps as workers change (a beat
    must not scan the fleet); after any sequence of changes they equal a recount, and
    the beat order holds the registered workers, the longest silent first."""
    rng, table = random.Random(7), WorkerTable()
    ids, stale = [f"w{i}" for i in range(6)], []
    table._export()  # the gauges are the process's: other tests' tables set them too
    for _ in range(3000):
        wid, op = rng.choice(ids), rng.randrange(7)
        w = table.workers.get(wid)
        if op == 0:
            table.add(wid, f"a:{wid}:{rng.randrange(2)}", 4, rng.randrange(3), 96, 512,
                      draining=rng.random() < 0.2, polled=rng.random() < 0.2)
        elif op == 1:
            table.mark_unhealthy(wid)
        elif op == 2 and w is not None:
            table.set_version(w, rng.randrange(3))
        elif op == 3 and w is not None:
            table.stop_accepting(w)
        elif op == 4 and w is not None:
            stale.append(table.remove(wid))
        elif op == 5 and w is not None:
            table.mark_healthy(w, rng.randrange(3), rng.random() < 0.8)
        elif op == 6 and stale:  # a late answer about a worker dropped meanwhile
            table.set_version(rng.choice(stale), rng.randrange(3))
        for version in rng.sample(range(3), 3):  # the kept serving list: a recount, whatever was asked before
            recount = [w for w in table.workers.values() if w.can_take_work and w.policy_version == version]
            assert table.serving(version) == recount
            assert table.any_serving(version) == bool(recount)
        healthy = sum(w.state.healthy for w in table.workers.values())
        assert (_gauge("true"), _gauge("false")) == (healthy, len(table.workers) - healthy)
        assert set(table.draining) == {i for i, w in table.workers.items() if not w.accepting}
        beats = list(table._by_beat.values())
        assert {w.worker_id for w in beats} == {i for i, w in table.workers.items() if not w.polled}
        assert [w.last_heard for w in beats] == sorted(w.last_heard for w in beats)
        table.heard_clock += rng.random()
    assert table.silent(time.monotonic() + 1) == beats


@run_async
async def test_a_worker_that_misses_its_beats_is_lost_and_its_chunks_run_elsewhere():
    """w1 falls silent with chunks on it: after MISSED_BEATS intervals the watchdog marks
    it unhealthy and re-queues its chunks, which w0 (beating) finishes; every sample
    arrives once. Silence counts only while the scheduler could hear: a minute in which
    its rounds came late and it read no beat from anyone (its loop swamped, the beats
    queued unread) makes nobody lost; punctual rounds (its loop free: the silence is the
    worker's) do."""
    link = FakeLink()
    link.gate = asyncio.Event()  # chunks wait on the workers
    core = make_core(link, workers=2, capacity=4)
    table = core.workers
    watchdog = Watchdog(core, WeightFanout(core), [], 30.0, _noop, heartbeat_s=5.0)
    run = await core.submit(step("s", {"a": [5, 6], "b": [7, 8]}, n=4, max_tokens=12))
    collecting = asyncio.create_task(collect(run))
    while len(table.workers["w1"].state.running) == 0:
        await dispatch_pass(core)
    w0, w1 = table.workers["w0"], table.workers["w1"]
    on_w1 = set(w1.state.running)

    table.beats, watchdog._beats = 0, deque()  # nothing read lately
    for _ in range(60):  # a minute of rounds that came a second late, no beat read from anyone
        watchdog._last_round = time.monotonic() - 2 * watchdog.sweep_s
        await watchdog.check_once()
    assert w1.state.healthy and w1.state.running and w0.state.healthy, "lost while the scheduler heard no one"
    for _ in range(MISSED_BEATS * 5 + 5):  # w0 beats, w1 stays silent, through 20 punctual rounds (1 s each)
        core.register("w0", "fake:0", 4, 0, 96, 512)
        watchdog._last_round = time.monotonic() - watchdog.sweep_s
        await watchdog.check_once()
    assert not w1.state.healthy and w0.state.healthy and "w1" in table.workers  # lost, not dropped yet (30 s)
    while w1.state.running:  # its Run calls, cancelled, hand their chunks back
        await asyncio.sleep(0)
    link.gate.set()
    samples, summary = await asyncio.wait_for(collecting, 30)
    assert sorted((s.prompt_id, s.sample_index) for s in samples) == [(p, i) for p in "ab" for i in range(4)]
    assert all(link.chunks_started[k] >= 2 for k in on_w1)  # each ran again, on w0
    await core.stop()


@run_async
async def test_a_lone_worker_that_falls_silent_is_lost_while_the_loop_is_free():
    """No beat from anyone, but the rounds come on time: the silence is the fleet's."""
    core = make_core(FakeLink(), workers=1)
    watchdog = Watchdog(core, WeightFanout(core), [], 30.0, _noop, heartbeat_s=5.0)
    core.workers.beats = 0  # its registration is long past
    for _ in range(MISSED_BEATS * 5 + 5):
        watchdog._last_round = time.monotonic() - watchdog.sweep_s
        await watchdog.check_once()
    assert not core.workers.workers["w0"].state.healthy and not core.workers.any_serving(0)
    await core.stop()


@run_async
async def test_a_round_that_took_long_but_slept_on_time_is_not_late():
    """A round's own work (its Redis calls, on a busy machine) is not lateness: the rounds
    below each took a second but their sleeps ended on time, so the lone silent worker is
    lost (in CI, counted as late, it never was and readiness never fell)."""
    core = make_core(FakeLink(), workers=1)
    watchdog = Watchdog(core, WeightFanout(core), [], 1000.0, _noop, heartbeat_s=5.0)
    core.workers.beats = 0
    for _ in range(MISSED_BEATS * 5 + 5):
        now = time.monotonic()
        watchdog._last_round = now - watchdog.sweep_s - 1.0  # the round before began 2 s ago...
        watchdog._slept_at = now - watchdog.sweep_s  # ...took a second, then slept on time
        await watchdog.check_once()
    assert not core.workers.workers["w0"].state.healthy and not core.workers.any_serving(0)
    await core.stop()


@run_async
async def test_a_silent_worker_is_lost_at_last_however_deaf_the_scheduler():
    """Every round late and no beat read, ever: silence still counts MIN_SHARE of the
    time, so the dead worker is lost within 1 / MIN_SHARE times its bound."""
    core = make_core(FakeLink(), workers=1)
    watchdog = Watchdog(core, WeightFanout(core), [], 1000.0, _noop, heartbeat_s=5.0)
    core.workers.beats = 0
    rounds = math.ceil(MISSED_BEATS * 5 / (2 * watchdog.sweep_s * MIN_SHARE)) + 2  # rounds count 2 s at most
    for _ in range(rounds):
        watchdog._last_round = time.monotonic() - 2 * watchdog.sweep_s
        await watchdog.check_once()
    assert not core.workers.workers["w0"].state.healthy
    await core.stop()


@run_async
async def test_beats_read_at_the_end_of_a_stall_keep_their_workers():
    """The loop stuck a minute, then it reads every worker's beat just before the round:
    nobody is lost (the stall counts for two rounds at most)."""
    core = make_core(FakeLink(), workers=2)
    watchdog = Watchdog(core, WeightFanout(core), [], 30.0, _noop, heartbeat_s=5.0)
    for w in ("w0", "w1"):
        core.register(w, f"fake:{w[1]}", 4, 0, 96, 512)
    watchdog._last_round = time.monotonic() - 60
    await watchdog.check_once()
    assert {i for i, w in core.workers.workers.items() if w.state.healthy} == {"w0", "w1"}
    await core.stop()


@run_async
async def test_a_draining_worker_beats_until_drained_and_a_draining_stranger_is_not_added():
    link = FakeLink()
    core = make_core(link, workers=2)
    watchdog = Watchdog(core, WeightFanout(core), [], 30.0, _noop, heartbeat_s=5.0)
    assert core.register("w9", "fake:9", 4, 0, 96, 512, draining=True) is None
    assert "w9" not in core.workers.workers
    w0 = core.register("w0", "fake:0", 4, 0, 96, 512, draining=True)
    assert not w0.accepting and not w0.can_take_work and core.workers.draining == {"w0": w0}
    await watchdog.check_once()  # nothing runs on it: drained
    assert "w0" not in core.workers.workers and core.workers.any_serving(0)
    await core.stop()


async def _noop(ready: bool) -> None:
    pass


class _Registry(worker_pb2_grpc.RegistryServiceServicer):
    """Answers a heartbeat stream's first beat, naming the interval; ends a stream
    after ``end_after`` beats (a scheduler restarting)."""

    def __init__(self, interval_s: float, end_after: int = 0):
        self.interval_s, self.end_after, self.beats, self.streams = interval_s, end_after, [], 0

    async def Heartbeat(self, request_iterator, context):  # noqa: N802 - gRPC's name
        self.streams += 1
        beats = 0
        async for request in request_iterator:
            self.beats.append((request.worker_id, request.draining))
            if not beats:
                yield worker_pb2.RegisterResponse(policy_version=0, heartbeat_s=self.interval_s)
            beats += 1
            if beats == self.end_after:
                return


class _Worker:
    worker_id, version, accepting, max_model_len = "w", 0, True, 512
    config = type("Config", (), {"vocab_size": 96, "max_position_embeddings": 512})()


@run_async
async def test_a_worker_beats_at_the_interval_its_scheduler_names_and_says_when_it_drains():
    """The worker's own setting is an hour: only the scheduler's answer (10 ms) can bring
    a second beat. A stream the scheduler ends is opened again (a restarted scheduler
    gets the worker back). Once it drains, its beats say so."""
    registry = _Registry(0.01, end_after=4)
    server = grpc.aio.server()
    worker_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    worker = _Worker()
    beating = asyncio.create_task(keep_registered(
        WorkerSettings(scheduler_address=f"127.0.0.1:{port}", heartbeat_s=3600.0), worker, "127.0.0.1:1"))
    try:
        while len(registry.beats) < 3:
            await asyncio.sleep(0.01)
        assert registry.beats[:3] == [("w", False)] * 3
        while registry.streams < 2:  # the stream ended after 4 beats: the worker opened another
            await asyncio.sleep(0.01)
        worker.accepting = False
        while registry.beats[-1] != ("w", True):
            await asyncio.sleep(0.01)
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await server.stop(0)


class _OldRegistry(worker_pb2_grpc.RegistryServiceServicer):
    """A scheduler from before the Heartbeat stream: Register calls only."""

    def __init__(self):
        self.beats = 0

    async def Register(self, request, context):  # noqa: N802 - gRPC's name
        self.beats += 1
        return worker_pb2.RegisterResponse(policy_version=0)


@run_async
async def test_a_worker_beats_with_register_calls_to_a_scheduler_without_the_stream():
    """Workers upgraded before their scheduler still register and beat (at their own
    interval: an older scheduler names none)."""
    registry = _OldRegistry()
    server = grpc.aio.server()
    worker_pb2_grpc.add_RegistryServiceServicer_to_server(registry, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    beating = asyncio.create_task(keep_registered(
        WorkerSettings(scheduler_address=f"127.0.0.1:{port}", heartbeat_s=0.01), _Worker(), "127.0.0.1:1"))
    try:
        while registry.beats < 3:
            await asyncio.sleep(0.01)
    finally:
        beating.cancel()
        await asyncio.gather(beating, return_exceptions=True)
        await server.stop(0)
