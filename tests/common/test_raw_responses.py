"""`raw_responses`: a servicer may answer some methods with bytes already serialized, and
the service stays registered whichever way the generated code registers it (grpcio-tools
>= 1.62 calls both `add_generic_rpc_handlers` and `add_registered_method_handlers`; older
code, as a bundle built for another machine may carry, only the first)."""

from __future__ import annotations

import grpc
import pytest
from rhymerl.v1 import rollout_pb2, rollout_pb2_grpc

from services.common.grpc_server import Server, raw_responses
from tests.aio import run_async


class Stats(rollout_pb2_grpc.RolloutServiceServicer):
    async def GetStats(self, request, context):
        return rollout_pb2.ServiceStats(policy_version=7).SerializeToString()  # already bytes

    async def CancelStep(self, request, context):
        return rollout_pb2.CancelStepResponse()  # a message, serialized as usual


def generic_only(add):
    """`add` as code from grpcio-tools before 1.62 behaves: the generic handler alone."""
    class OnlyGeneric:
        def __init__(self, server):
            self.server = server

        def add_generic_rpc_handlers(self, handlers):
            self.server.add_generic_rpc_handlers(handlers)

        def add_registered_method_handlers(self, name, handlers):
            pass

    return lambda servicer, server: add(servicer, OnlyGeneric(server))


@pytest.mark.parametrize("codegen", ["current", "before-1.62"])
@run_async
async def test_raw_and_plain_answers_reach_the_client(codegen):
    add = rollout_pb2_grpc.add_RolloutServiceServicer_to_server
    add = add if codegen == "current" else generic_only(add)
    server = Server([(raw_responses(add, ["GetStats"]), Stats())], ["rhymerl.v1.RolloutService"])
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            assert (await stub.GetStats(rollout_pb2.GetStatsRequest())).policy_version == 7
            assert await stub.CancelStep(rollout_pb2.CancelStepRequest(step_id="s")) == \
                rollout_pb2.CancelStepResponse()
    finally:
        await server.server.stop(None)
