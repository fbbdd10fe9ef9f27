"""Weight pushes seen from the scheduler core, with in-process fake workers."""

from __future__ import annotations

import time

import pytest
from rhymerl.v1 import common_pb2

from services.common.errors import FailedPrecondition
from services.common.redis_server import free_port
from services.scheduler.serving import SETTLE_S
from services.scheduler.step_log import StepLog
from services.scheduler.weight_fanout import WeightFanout
from tests.aio import run_async
from tests.scheduler.fake_workers import FakeLink, collect, dispatch_pass, make_core, step


@run_async
async def test_a_lagging_worker_is_caught_up_only_from_the_serving_versions_own_source():
    """After a restart the scheduler may learn a version from its workers; a path recorded
    for another version must not be loaded under this one's number."""
    link = FakeLink()
    core = make_core(link)
    fanout = WeightFanout(core)
    core.serving.restore(18)
    worker = core.workers.workers["w0"]
    fanout.source = (15, "", "/checkpoints/odd")
    await fanout.catch_up(worker)
    assert link.loads == [] and worker.policy_version == 0
    fanout.source = (18, "", "/checkpoints/even")
    await fanout.catch_up(worker)
    assert link.loads == [("w0", 18, "/checkpoints/even")] and worker.policy_version == 18
    await core.stop()


@run_async
async def test_loading_the_serving_path_again_is_acknowledged_and_catches_up_laggards():
    link = FakeLink()
    core = make_core(link)
    fanout = WeightFanout(core)
    assert (await fanout.load(common_pb2.LoadWeightsRequest(version=1, path="/a"))).version == 1
    assert sorted(link.loads) == [("w0", 1, "/a"), ("w1", 1, "/a")]
    core.workers.workers["w1"].policy_version = 0  # restarted on its initial weights
    again = await fanout.load(common_pb2.LoadWeightsRequest(version=1, path="/a"))
    assert again.num_workers_updated == 2 and link.loads[-1] == ("w1", 1, "/a")
    with pytest.raises(FailedPrecondition):
        await fanout.load(common_pb2.LoadWeightsRequest(version=1, path="/b"))
    await core.stop()


@run_async
async def test_an_unreadable_record_holds_dispatch_until_the_fleets_version_settles():
    """Redis down as the scheduler starts: a worker restarted on its initial weights may
    register before the fleet's newer one. Nothing is dispatched (and readiness says so)
    until the version settles, so no sample starts on v0 and goes on under v3 (seen in the
    fault campaign: 45 samples with two versions)."""
    link = FakeLink()
    link.versions = {"w0": 0, "w1": 3}
    core = make_core(link, workers=0)
    # hold_s=0: the step is submitted at once (with the default, it waits up to 30 s for
    # Redis to know whether it was logged; test_log_outage.py)
    core.log = StepLog(f"redis://127.0.0.1:{free_port()}/0", hold_s=0)
    await WeightFanout(core).restore()
    assert core.serving.unreadable and not core.serving.dispatchable
    core.register("w0", "fake:0", 4, 0, 96, 512)  # restarted on its initial weights: comes first
    run = await core.submit(step("s", {"p": [1, 2, 3]}, n=4))
    await dispatch_pass(core)  # the dispatch loop has looked at the queue: it must send nothing
    assert not link.chunks_started and not core.runs.num_chunks
    core.register("w1", "fake:1", 4, 3, 96, 512)
    assert core.policy_version == 3 and not link.chunks_started
    core.serving.settle([0, 3], nobody_serves=False, now=time.monotonic() + SETTLE_S + 1)
    assert core.serving.dispatchable
    core.wake()
    samples, _ = await collect(run)
    assert len(samples) == 4
    # one version per sample (token_policy_versions is filled only when they are mixed)
    assert all(s.policy_version == 3 and not s.token_policy_versions for s in samples)
    await core.stop()


@run_async
async def test_a_readable_redis_without_a_record_dispatches_at_once():
    """A fresh deployment (Redis answers, no push recorded yet) learns from its workers
    without waiting."""
    link = FakeLink()
    core = make_core(link)
    await WeightFanout(core).restore()
    assert core.serving.dispatchable
    samples, _ = await collect(await core.submit(step("s", {"p": [1, 2, 3]}, n=2)))
    assert len(samples) == 2
    await core.stop()
