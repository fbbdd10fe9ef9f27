"""Weight pushes seen from the scheduler core, with in-process fake workers."""

from __future__ import annotations

import pytest
from rhymerl.v1 import common_pb2

from services.common.errors import FailedPrecondition
from services.scheduler.weight_fanout import WeightFanout
from tests.aio import run_async
from tests.scheduler.fake_workers import FakeLink, make_core


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
