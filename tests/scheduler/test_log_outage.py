"""The step log while its Redis is down (a real redis-server, append-only, kill -9'd and
restarted: its own process).

The chaos campaign's duplicates (issue 29): Redis killed mid-step, the log skipped for
5 s while the step's samples streamed to the trainer, the scheduler killed, a push
before the trainer re-submitted: the new scheduler found no logged sample and generated
them all again at the new version, so the trainer got each (prompt, sample index) a
second time with other tokens. A sample now waits for Redis (``hold_s``) before the
trainer sees it.
"""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time

import pytest
import redis
from prometheus_client import REGISTRY
from rhymerl.v1 import rollout_pb2

from services.common.redis_server import find_redis_server, free_port
from services.scheduler.step_log import StepLog
from tests.aio import run_async
from tests.scheduler.fake_workers import FakeLink, collect, make_core, step

pytestmark = pytest.mark.timeout(120)
PROMPTS = {"a": [3, 4, 5], "b": [6, 7]}
HOLD_S = 600.0  # far longer than a Redis restart takes on any machine: the test never reaches it


class DurableRedis:
    """redis-server with an append-only file synced on every write (what the chaos
    campaign and a deployment with a volume run): a kill -9 loses nothing."""

    def __init__(self) -> None:
        self.port, self._dir = free_port(), tempfile.TemporaryDirectory(prefix="rhymerl-aof-")
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
             "yes", "--appendfsync", "always", "--dir", self._dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1)
        while True:  # the test's timeout bounds this
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert self._proc.poll() is None, "redis-server exited"
                time.sleep(0.02)
        client.close()

    def kill9(self) -> None:
        self._proc.kill()
        self._proc.wait()

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self.kill9()
        self._dir.cleanup()


@pytest.fixture
def durable_redis():
    server = DurableRedis()
    server.start()
    yield server
    server.close()


def failed_writes() -> float:
    return REGISTRY.get_sample_value("rhymerl:step_log_writes_total", {"result": "failed"}) or 0.0


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


def sample(prompt_id: str, k: int) -> tuple[tuple[str, int], bytes]:
    """As delivery logs a sample: its key and its SampleResult, serialized."""
    return (prompt_id, k), rollout_pb2.SampleResult(step_id="s", prompt_id=prompt_id, sample_index=k,
                                                    token_ids=[k, 5]).SerializeToString()


@run_async
async def test_a_write_waits_for_redis_to_come_back(durable_redis):
    log = StepLog(durable_redis.url, timeout_s=0.5, hold_s=HOLD_S)
    try:
        await log.open("s", "fp", ["p"], 2)
        durable_redis.kill9()
        assert await log.save_serving(1, "", "/ckpt") is False  # a write that does not wait fails at once...
        failed = failed_writes()
        write = asyncio.ensure_future(log.append("s", [sample("p", 0)]))  # ...and samples still wait
        await until(lambda: failed_writes() > failed or write.done())
        assert not write.done() and log.holding  # not skipped, not given up: the sample is not out yet
        durable_redis.start()
        assert await write is True and not log.holding
        assert [s.sample_index for s in (await log.load("s")).samples] == [0]
    finally:
        await log.shutdown()


@run_async
async def test_past_the_hold_a_dead_redis_costs_the_trainer_nothing_but_the_log():
    log = StepLog(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5, retry_s=3600, hold_s=0.0)
    skipped = REGISTRY.get_sample_value("rhymerl:step_log_writes_total", {"result": "skipped"}) or 0.0
    assert await log.append("s", [sample("p", 0)]) is False  # tried, failed, given up (no hold)
    assert await log.append("s", [sample("p", 1)]) is False  # skipped: Redis not asked for retry_s
    assert REGISTRY.get_sample_value("rhymerl:step_log_writes_total", {"result": "skipped"}) == skipped + 1
    assert await log.load("s") is None
    await log.shutdown()


@run_async
async def test_a_shutdown_ends_the_wait():
    log = StepLog(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5, hold_s=HOLD_S)
    failed = failed_writes()
    write = asyncio.ensure_future(log.append("s", [sample("p", 0)]))
    await until(lambda: failed_writes() > failed)
    await log.shutdown()
    assert await write is False


@run_async
async def test_samples_streamed_while_redis_was_down_are_replayed_not_regenerated_after_a_push(durable_redis):
    """Redis is killed while a step's samples finish; once it is back the scheduler is
    "restarted" (a second core on the same Redis) and a push made version 1 serving
    before the trainer re-submits: every sample the trainer saw comes back as it saw it
    (version 0), none is generated again. Before the fix the log was skipped for 5 s, the
    samples streamed unlogged, and the second scheduler generated all of them again at
    version 1: the same keys with other tokens for a real policy."""
    link = FakeLink()
    first = make_core(link, chunk_size=100)
    first.log = StepLog(durable_redis.url, timeout_s=0.5, hold_s=HOLD_S)
    link.gate = asyncio.Event()
    request = step("s", PROMPTS, n=3)
    run = await first.submit(request)  # its record is logged: Redis is up
    durable_redis.kill9()
    failed = failed_writes()
    trainer = asyncio.ensure_future(collect(run))
    link.gate.set()  # the samples finish while Redis is down
    await until(lambda: failed_writes() > failed)  # a write met the dead Redis
    durable_redis.start()
    seen, _ = await trainer
    await first.stop()
    await first.log.shutdown()

    link2 = FakeLink()
    second = make_core(link2, workers=0, chunk_size=100)
    second.log = StepLog(durable_redis.url, timeout_s=0.5, hold_s=HOLD_S)
    second.register("w0", "fake:0", 4, 1, 96, 512)  # the fleet on version 1 (a push after the restart)
    assert second.policy_version == 1
    try:
        again, summary = await collect(await second.submit(request))
        assert summary.num_samples == 6 and len(seen) == 6
        def as_seen(samples) -> dict:
            return {(s.prompt_id, s.sample_index): (s.policy_version, list(s.token_ids)) for s in samples}

        assert as_seen(again) == as_seen(seen)  # before the fix: every sample again, at version 1
        assert not link2.chunks_started  # nothing generated again
        assert {s.SerializeToString() for s in again} == {s.SerializeToString() for s in seen}
    finally:
        await second.stop()
        await second.log.shutdown()
