"""What a Run call's status means for its samples; the link's channels and stubs."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
from rhymerl.v1 import common_pb2, worker_pb2_grpc

from benchmarks.fake_fleet import FleetSpec, make_servicer
from services.common.grpc_server import Server
from services.scheduler.policies.base import RequestKey, WorkerState
from services.scheduler.worker_link import Chunk, ChunkDone, GrpcWorkerLink, RunEnded, RunOutcome, outcome
from services.scheduler.workers import WorkerHandle
from tests.aio import run_async


def test_only_the_workers_own_failures_count_against_the_samples():
    code = grpc.StatusCode
    assert outcome(code.INTERNAL, "internal error in WorkerServicer.Run: RuntimeError: boom") \
        is RunOutcome.ENGINE_FAILED
    # A worker killed mid-stream: the transport's words, not the samples' fault.
    assert outcome(code.UNKNOWN, "Stream removed") is RunOutcome.LOST
    assert outcome(code.INTERNAL, "Received RST_STREAM with error code 2") is RunOutcome.LOST
    assert outcome(code.UNAVAILABLE, "Socket closed") is RunOutcome.LOST
    assert outcome(code.INVALID_ARGUMENT, "items[0].sampling.top_p: must be in [0, 1]") is RunOutcome.REJECTED
    assert outcome(code.FAILED_PRECONDITION, "policy_version: ...") is RunOutcome.WRONG_VERSION


@run_async
async def test_one_stub_per_worker_channel_dropped_with_it():
    """Over real gRPC (two fake workers of the control-plane benchmark): the stub is built
    once per channel, not per call; a worker that moved gets a new channel and stub and
    its old channel is closed; a forgotten worker's next call opens afresh."""
    counts: Counter = Counter()
    servers = []
    for worker_id in ("first", "second"):
        server = Server([(worker_pb2_grpc.add_WorkerServiceServicer_to_server,
                          make_servicer(worker_id, FleetSpec("unused:1", 1, response_tokens=3), counts))],
                        ["rhymerl.v1.WorkerService"])
        await server.start("127.0.0.1", 0)
        servers.append(server)
    link = GrpcWorkerLink()
    try:
        w = WorkerHandle("w", f"127.0.0.1:{servers[0].port}", WorkerState(worker_id="w", capacity=4))
        stub = link.stub(w)
        assert (await link.stats(w)).worker_id == "first"
        chunk = Chunk("d0", RequestKey("s", "p", 0), [5, 6], [], common_pb2.SamplingParams(max_tokens=8), 8, 1)
        events = [e async for e in link.run(w, 0, [chunk])]
        assert [type(e) for e in events] == [ChunkDone, RunEnded] and events[0].token_ids and events[1].outcome \
            is RunOutcome.DONE
        assert link.stub(w) is stub and counts["runs"] == 1 and counts["stats"] == 1

        old_channel = link._channels["w"][1]
        w.address = f"127.0.0.1:{servers[1].port}"  # restarted elsewhere
        moved = link.stub(w)
        assert moved is not stub and (await link.stats(w)).worker_id == "second"
        while old_channel.get_state() is not grpc.ChannelConnectivity.SHUTDOWN:
            await asyncio.sleep(0.01)

        await link.forget("w")
        assert "w" not in link._channels
        assert link.stub(w) is not moved and (await link.stats(w)).worker_id == "second"
    finally:
        await link.close()
        for server in servers:
            await server.stop(0)
