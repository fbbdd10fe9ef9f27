"""A rejected weight push, over real gRPC with real in-process workers: the scheduler
checks the push's header itself (every bound the workers check, with their own check)
before it opens a stream to any worker, so the trainer always gets INVALID_ARGUMENT
naming the field, never the retryable UNAVAILABLE of a worker's refusal racing with the
data still being forwarded to it (an outside probe: 1 push in 15 came back as
"UNAVAILABLE: no worker took version 5 (...: INTERNAL: Internal error from Core)"). A
push whose worker streams end while the scheduler still forwards tears its forwarding
down cleanly: nothing left pending for the garbage collector to report."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import time

import grpc
import pytest
from prometheus_client import REGISTRY
from rhymerl import RolloutClient
from rhymerl.v1 import common_pb2, rollout_pb2_grpc

from tests.e2e.cluster import Cluster, expect_status
from tests.e2e.test_push_faults import HeldPush
from tests.e2e.test_weight_pushes import weights

pytestmark = pytest.mark.timeout(300)
REPEAT = 20
DATA = b"xx"
GOOD = {"version": 5, "total_bytes": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest()}
BAD_HEADERS = [  # (the field named, the header's fields)
    ("header.total_bytes", {**GOOD, "total_bytes": 2 ** 62}),
    ("header.total_bytes", {**GOOD, "total_bytes": (1 << 40) + 1}),
    ("header.total_bytes", {**GOOD, "total_bytes": 0}),
    ("header.total_bytes", {**GOOD, "total_bytes": -2}),
    ("header.sha256", {**GOOD, "sha256": "zz"}),
    ("header.sha256", {**GOOD, "sha256": "zz" * 32}),  # 64 characters, not hex
    ("header.sha256", {**GOOD, "sha256": ""}),
    ("header.sha256", {**GOOD, "sha256": "00" * 33}),
    ("header.sha256", {**GOOD, "sha256": "../" * 21 + "x"}),  # the store names its files by it
]
ASYNCIO_ERRORS = ("Task was destroyed but it is pending", "Task exception was never retrieved",
                  "asynchronous generator is already running")


@pytest.fixture
def cluster(model_dir, redis_url):
    c = Cluster(model_dir=model_dir, redis_url=redis_url, chunk_tokens=8).start()
    yield c
    c.stop()


class StreamsOpened:
    """Counts the PushWeights streams the scheduler opens to workers (its link's stubs)."""

    def __init__(self, cluster: Cluster):
        self.count = 0
        link = cluster.scheduler.core.link
        stub_of = link.stub

        def stub(worker):
            real = stub_of(worker)
            spy = self

            class Counted:
                def __getattr__(self, name):
                    return getattr(real, name)

                def PushWeights(self, *args, **kwargs):  # the stub's method
                    spy.count += 1
                    return real.PushWeights(*args, **kwargs)
            return Counted()
        link.stub = stub


def collect_garbage(cluster: Cluster) -> None:
    """Collects, on the services' loop, whatever a push left behind, and lets the loop run
    what that schedules (an async generator's finalizer), so that a task left pending, or
    a failure nobody retrieved, is reported now (in this test's log) rather than whenever
    the collector happens to run."""
    async def collect():
        for _ in range(3):
            gc.collect()
            for _ in range(5):
                await asyncio.sleep(0)
    cluster.run(collect())


def asyncio_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and any(e in r.getMessage() for e in ASYNCIO_ERRORS)]


def push(stub, header: dict, data: bytes = DATA):
    chunks = [common_pb2.WeightChunk(header=common_pb2.WeightHeader(**header)), common_pb2.WeightChunk(data=data)]
    return stub.PushWeights(iter(chunks), timeout=60)


def test_bad_headers_are_invalid_argument_every_time_and_reach_no_worker(cluster, caplog):
    caplog.set_level(logging.WARNING)
    opened = StreamsOpened(cluster)
    with grpc.insecure_channel(cluster.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        for field, header in BAD_HEADERS:
            for _ in range(REPEAT):
                with pytest.raises(grpc.RpcError) as err:
                    push(stub, header)
                expect_status(err.value, "INVALID_ARGUMENT", field)
        assert opened.count == 0, "a bad header was forwarded to a worker"
        with pytest.raises(grpc.RpcError) as err:  # no header at all
            stub.PushWeights(iter([common_pb2.WeightChunk(data=DATA)]), timeout=60)
        expect_status(err.value, "INVALID_ARGUMENT", "header")

        # more bytes than the header announced: refused by the scheduler before it
        # forwards them (a worker's refusal would race with the rest of the data)
        data = weights(seed=1)
        header = {"version": 1, "total_bytes": len(data) - 1, "sha256": hashlib.sha256(data).hexdigest()}
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as err:
                push(stub, header, data)
            expect_status(err.value, "INVALID_ARGUMENT", "data")

    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.stats().policy_version == 0
        opened.count = 0
        assert client.push_weights(1, data) == 1  # a good push still goes through, to both workers
        assert opened.count == 2
        assert {w.policy_version for w in client.stats().workers} == {1}

    # an older or equal version with other bytes, once the scheduler knows the serving one's
    opened.count = 0
    with grpc.insecure_channel(cluster.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        for version in (1, 0, -1):
            for _ in range(REPEAT):
                with pytest.raises(grpc.RpcError) as err:
                    push(stub, {**GOOD, "version": version})
                expect_status(err.value, "FAILED_PRECONDITION", "version")
        for _ in range(REPEAT):  # a bad header of an old version: the header is checked first
            with pytest.raises(grpc.RpcError) as err:
                push(stub, {**GOOD, "version": 0, "total_bytes": 2 ** 62})
            expect_status(err.value, "INVALID_ARGUMENT", "header.total_bytes")
    assert opened.count == 0
    collect_garbage(cluster)
    assert asyncio_errors(caplog) == []


def test_a_worker_stream_that_ends_mid_push_is_torn_down_cleanly(cluster, caplog):
    """A worker killed while the scheduler forwards a push to it (its stream waits for
    the trainer's next chunk): the push goes on with the other worker, and the dead
    worker's forwarding ends with its call, not left pending until collected."""
    caplog.set_level(logging.WARNING)
    data = weights(seed=1)
    push = HeldPush(cluster.address, 1, data)
    deadline = time.monotonic() + 60
    while not REGISTRY.get_sample_value("rhymerl:weight_pushes_in_progress", {"component": "w1"}):
        assert time.monotonic() < deadline, "the push never reached w1"
        time.sleep(0.01)
    cluster.kill_worker("w1")
    answer = push.release()
    assert (answer.version, answer.num_workers_updated) == (1, 1)
    collect_garbage(cluster)
    assert asyncio_errors(caplog) == []


def test_the_scheduler_bounds_a_payload_as_the_workers_do():
    """The scheduler keeps its own copy of the workers' size bound (importing the worker's
    server would load torch into it): they must not drift apart."""
    from services.rollout.weight_receiver import MAX_WEIGHT_BYTES
    from services.scheduler import weight_fanout

    assert weight_fanout.MAX_WEIGHT_BYTES == MAX_WEIGHT_BYTES


def test_a_push_larger_than_the_model_can_be_is_refused_at_its_header(cluster):
    """A worker buffers a push whole before it checks it: a header announcing far more bytes
    than the model's weights can take (a wrong file, optimizer state) was accepted up to
    1 TiB, and the worker's memory grew with every chunk (an outside probe: 1.5 GiB streamed
    for a 349 KB model took its RSS from 425 MiB to 2 GiB, kept after the push failed). The
    worker refuses it at the header, naming the field; a good push still goes through."""
    data = weights(seed=2)
    too_big = 8 * (1 << 30)  # far above what the tiny model's tensors take at 8 bytes per value
    header = {"version": 1, "total_bytes": too_big, "sha256": hashlib.sha256(data).hexdigest()}
    with grpc.insecure_channel(cluster.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as err:
                chunks = [common_pb2.WeightChunk(header=common_pb2.WeightHeader(**header))]
                chunks += [common_pb2.WeightChunk(data=b"x" * (1 << 20)) for _ in range(8)]
                stub.PushWeights(iter(chunks), timeout=60)
            expect_status(err.value, "INVALID_ARGUMENT", "header.total_bytes")
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.stats().policy_version == 0
        assert client.push_weights(1, data) == 1
        assert {w.policy_version for w in client.stats().workers} == {1}
