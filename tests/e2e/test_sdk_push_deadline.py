"""The SDK's weight push is bounded even by a server that never answers: a trainer must
not wait forever (docs/smollm2.md: a push that never returned)."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest
from rhymerl import RolloutClient
from rhymerl.aio import AsyncRolloutClient
from rhymerl.v1 import common_pb2, rollout_pb2_grpc

from services.common.redis_server import free_port

pytestmark = pytest.mark.timeout(120)


class NeverAnswers(rollout_pb2_grpc.RolloutServiceServicer):
    """Reads a push to its end, then holds it until the test ends (a wedged scheduler)."""

    def __init__(self):
        self.attempts, self.released = 0, threading.Event()

    def PushWeights(self, request_iterator, context):  # noqa: N802 - gRPC's name
        self.attempts += 1
        for _ in request_iterator:
            pass
        self.released.wait()
        return common_pb2.WeightUpdateResponse(version=1)


@pytest.fixture
def wedged():
    servicer = NeverAnswers()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(servicer, server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    servicer.released.set()
    server.stop(0)


def test_push_weights_ends_within_its_deadline_retries_included(wedged):
    address, servicer = wedged
    with RolloutClient(address, timeout_s=600, max_retries=3) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.push_weights(1, b"x" * 1000, timeout_s=1.0)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.attempts >= 1
    with RolloutClient(address, max_retries=3, push_timeout_s=1.0) as client:  # the client's default bound
        with pytest.raises(grpc.RpcError) as err:
            client.push_weights(1, b"x" * 1000)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_asyncio_push_weights_is_bounded_too(wedged):
    address, _ = wedged

    async def push():
        async with AsyncRolloutClient(address, max_retries=3, push_timeout_s=1.0) as client:
            await client.push_weights(1, b"x" * 1000)

    with pytest.raises(grpc.RpcError) as err:
        asyncio.run(push())
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED

