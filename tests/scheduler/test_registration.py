"""RegistryService refuses registrations that cannot be a worker's, naming the field,
over real gRPC (Register and the Heartbeat stream alike); nothing of them is kept."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from rhymerl.v1 import worker_pb2, worker_pb2_grpc

from services.common.errors import InvalidArgument

GOOD = dict(worker_id="w0", address="127.0.0.1:50061", max_num_seqs=8, vocab_size=96, max_model_len=512)

BAD = [
    ({"max_num_seqs": -5}, "max_num_seqs"),
    ({"max_num_seqs": 1 << 30}, "max_num_seqs"),
    ({"vocab_size": 1}, "vocab_size"),
    ({"vocab_size": -3}, "vocab_size"),
    ({"max_model_len": 3}, "max_model_len"),
    ({"max_model_len": -1}, "max_model_len"),
    ({"worker_id": ""}, "worker_id"),
    ({"worker_id": "w" * 10_000}, "worker_id"),
    ({"address": ""}, "address"),
    ({"address": "not an address"}, "address"),
    ({"address": "host"}, "address"),
    ({"address": "host:0"}, "address"),
    ({"address": "host:70000"}, "address"),
    ({"address": ":50061"}, "address"),
    ({"address": "fd00::1:50061"}, "address"),
    ({"address": "h" * 300 + ":1"}, "address"),
    ({"policy_version": -1}, "policy_version"),
]


async def with_scheduler(body):
    from services.scheduler.server import start_scheduler
    from services.scheduler.settings import SchedulerSettings

    server, port, stop = await start_scheduler(SchedulerSettings(host="127.0.0.1", port=0, metrics_port=0,
                                                                 health_port=0, history_address=""))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await body(worker_pb2_grpc.RegistryServiceStub(ch), server.core)
    finally:
        await stop()


@pytest.mark.parametrize("change,field", BAD, ids=[f"{f}={list(c.values())[0]!r:.20}" for c, f in BAD])
def test_a_nonsense_registration_is_invalid_argument_naming_its_field(change, field):
    request = worker_pb2.RegisterRequest(**{**GOOD, **change})

    async def body(stub, core):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Register(request, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}:"), err.value.details()
        call = stub.Heartbeat(timeout=30)
        await call.write(request)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}:"), err.value.details()
        assert core.workers.workers == {}
    asyncio.run(asyncio.wait_for(with_scheduler(body), 60))


def test_a_sound_registration_is_kept_and_older_workers_zeros_still_register():
    async def body(stub, core):
        await stub.Register(worker_pb2.RegisterRequest(**GOOD), timeout=30)
        # an older worker leaves max_num_seqs (taken as 1), vocab_size, max_model_len unset
        await stub.Register(worker_pb2.RegisterRequest(worker_id="old", address="[::1]:50062"), timeout=30)
        workers = core.workers.workers
        assert sorted(workers) == ["old", "w0"]
        assert (workers["w0"].address, workers["w0"].vocab_size, workers["w0"].max_model_len) == \
            ("127.0.0.1:50061", 96, 512)
        assert workers["old"].state.capacity == 1
    asyncio.run(asyncio.wait_for(with_scheduler(body), 60))


@pytest.mark.parametrize("address", ["127.0.0.1:1", "worker-0.rhymerl:50061", "[fd00::1]:65535", "10.0.0.7:50061"])
def test_host_port_accepts_addresses(address):
    from services.common.validation import check_host_port

    check_host_port(address, "address")


def test_host_port_names_the_field():
    from services.common.validation import check_host_port

    with pytest.raises(InvalidArgument, match=r"^address: must be host:port"):
        check_host_port("10.0.0.7", "address")
