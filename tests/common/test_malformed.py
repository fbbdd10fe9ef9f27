"""Requests that do not parse: the field whose bytes are not UTF-8 is named, at any depth;
and requests that do parse go through the interceptor to every kind of method."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rhymerl.v1 import rollout_pb2

from services.common.grpc_server import Server
from services.common.malformed import bad_utf8_field
from tests.aio import run_async

BAD = b"\xc3\x28"  # not UTF-8


def field_bytes(number: int, payload: bytes) -> bytes:
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_names_a_top_level_string():
    data = rollout_pb2.SubmitStepRequest(n=2).SerializeToString() + field_bytes(1, BAD)
    assert bad_utf8_field(data, rollout_pb2.SubmitStepRequest.DESCRIPTOR) == "step_id"


def test_names_a_string_inside_a_repeated_message_with_its_index():
    good = rollout_pb2.SubmitStepRequest(step_id="s", prompts=[{"prompt_id": "a", "token_ids": [1]}])
    data = good.SerializeToString() + field_bytes(3, field_bytes(1, BAD))  # prompts[1].prompt_id
    assert bad_utf8_field(data, rollout_pb2.SubmitStepRequest.DESCRIPTOR) == "prompts[1].prompt_id"


def test_valid_or_truncated_bytes_name_nothing():
    good = rollout_pb2.SubmitStepRequest(step_id="é", prompts=[{"prompt_id": "a"}]).SerializeToString()
    assert bad_utf8_field(good, rollout_pb2.SubmitStepRequest.DESCRIPTOR) is None
    assert bad_utf8_field(b"\x0a\xff\xff", rollout_pb2.SubmitStepRequest.DESCRIPTOR) is None


@run_async
async def test_a_stream_answered_with_context_write_passes_the_interceptor():
    """grpc_health's aio Watch writes with context.write instead of yielding: behind the
    interceptor every Server's Watch failed UNKNOWN ("'async for' requires an object with
    __aiter__ method, got coroutine")."""
    server = Server([], [])
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=30)
            assert (await call.read()).status == health_pb2.HealthCheckResponse.SERVING
            await server.set_serving(False)
            assert (await call.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            call.cancel()
    finally:
        await server.stop(0)
