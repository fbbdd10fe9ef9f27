"""Weight pushes seen from the scheduler core, with in-process fake workers."""

from __future__ import annotations

import asyncio
import hashlib
import time

import grpc
import pytest
from rhymerl.v1 import common_pb2

from services.common.errors import DeadlineExceeded, FailedPrecondition, Unavailable
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
    core.workers.set_version(core.workers.workers["w1"], 0)  # restarted on its initial weights
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


class PushLink(FakeLink):
    """FakeLink whose workers also take PushWeights, each as ``behaviour`` says:
    "take" (reads it all, answers), "die" (its call fails after the header, as a killed
    worker's), "cut" (its call is cancelled after the header, as by a closed channel),
    "stall" (reads nothing past the header, never answers: a stopped process),
    "silent" (reads it all, never answers: stuck loading)."""

    def __init__(self, behaviour: dict[str, str]):
        super().__init__()
        self.behaviour = behaviour
        self.received: dict[str, int] = {}  # worker_id -> payload bytes of a push it took

    def stub(self, worker):
        stub, link = super().stub(worker), self

        async def push_weights(chunks, timeout=None):
            how = link.behaviour.get(worker.worker_id, "take")
            it = aiter(chunks)
            header = (await anext(it)).header
            if how == "die":
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "Connection reset by peer")
            if how == "cut":
                raise asyncio.CancelledError
            if how == "stall":
                await asyncio.Event().wait()
            size = sum([len(c.data) async for c in it])
            if how == "silent":
                await asyncio.Event().wait()
            link.received[worker.worker_id] = size
            return common_pb2.WeightUpdateResponse(version=header.version, num_workers_updated=1)
        stub.PushWeights = push_weights
        return stub


def payload(n: int = 12, size: int = 1000) -> tuple[bytes, list[common_pb2.WeightChunk]]:
    """A payload in ``n`` chunks: more than the fan-out's per-worker queue holds."""
    data = bytes(range(256)) * (n * size // 256 + 1)
    data = data[:n * size]
    header = common_pb2.WeightHeader(version=1, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    return data, [common_pb2.WeightChunk(header=header)] + [
        common_pb2.WeightChunk(data=data[i:i + size]) for i in range(0, len(data), size)]


async def stream(chunks, hold: asyncio.Event | None = None):
    """The trainer's side: the chunks, then (with ``hold``) nothing more until it is set."""
    for c in chunks:
        yield c
    if hold is not None:
        await hold.wait()


@pytest.mark.parametrize("fault", ["die", "cut", "stall"])
@run_async
async def test_a_push_goes_on_without_a_worker_that_dies_is_cut_off_or_stalls_mid_stream(fault):
    """The fan-out used to wait forever on the queue of a worker whose stream had ended
    (killed; its channel closed under the push) or that took nothing more: the trainer's
    push never returned. Now the other worker takes the version; the faulty one keeps
    its own and gets no work until it is caught up."""
    link = PushLink({"w1": fault})
    core = make_core(link)
    fanout = WeightFanout(core, stall_s=2.0)  # reached only by the worker that takes nothing
    data, chunks = payload()
    response = await fanout.push(stream(chunks))
    assert (response.version, response.num_workers_updated) == (1, 1)
    assert core.policy_version == 1 and link.received == {"w0": len(data)}
    assert [core.workers.workers[w].policy_version for w in ("w0", "w1")] == [1, 0]
    assert not core.paused and not core.hold_new_steps
    await core.stop()


@run_async
async def test_a_push_no_worker_took_fails_unavailable_naming_each_worker_and_what_happened():
    """Not a hang, not a bare CANCELLED: UNAVAILABLE (the SDK retries it), each worker
    named with its fate; the previous version keeps serving and dispatch goes on."""
    link = PushLink({"w0": "die", "w1": "cut"})
    core = make_core(link)
    fanout = WeightFanout(core, stall_s=2.0)
    with pytest.raises(Unavailable) as err:
        await fanout.push(stream(payload()[1]))
    message = str(err.value)
    assert message.startswith("no worker took version 1 (")
    assert "w0: UNAVAILABLE: Connection reset by peer" in message and "w1: its call was cancelled" in message
    assert core.policy_version == 0 and not core.paused and not core.hold_new_steps

    link.behaviour = {"w0": "silent", "w1": "silent"}  # both read it all and never answer
    with pytest.raises(Unavailable) as err:
        await fanout.push(stream(payload()[1]))
    assert "w0: did not answer within 2 s of the last chunk" in str(err.value)

    link.behaviour = {}  # a retry of the same version and bytes takes
    assert (await fanout.push(stream(payload()[1]))).version == 1
    samples, _ = await collect(await core.submit(step("after", {"p": [1, 2, 3]}, n=2)))
    assert len(samples) == 2 and all(s.policy_version == 1 for s in samples)
    await core.stop()


@run_async
async def test_a_trainer_that_stops_sending_ends_its_push_and_releases_the_fleet():
    """While a push streams, new steps wait for it: a trainer that sends nothing more
    (and keeps its connection) must not hold them forever."""
    link = PushLink({})
    core = make_core(link)
    fanout = WeightFanout(core, stall_s=2.0)
    with pytest.raises(DeadlineExceeded) as err:
        await fanout.push(stream(payload()[1][:3], hold=asyncio.Event()))
    assert str(err.value).startswith("data: no chunk came from the trainer for 2 s")
    assert core.policy_version == 0 and not core.paused and not core.hold_new_steps
    samples, _ = await collect(await core.submit(step("after", {"p": [1, 2, 3]}, n=2)))
    assert len(samples) == 2 and all(s.policy_version == 0 for s in samples)
    await core.stop()
