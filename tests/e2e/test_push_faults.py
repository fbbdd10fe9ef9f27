"""A weight push meets a worker fault mid-stream, with the services as separate processes
(docs/smollm2.md: the push that never returned). The fault is forced, not left to load:
the trainer's stream is held after its header until the test has made the fault, and
every wait is on a state (a metric, the scheduler's stats), never on a delay."""

from __future__ import annotations

import hashlib
import signal
import threading
import time

import grpc
import pytest
from rhymerl import RolloutClient
from rhymerl.v1 import common_pb2, rollout_pb2_grpc, worker_pb2, worker_pb2_grpc

from services.local import LocalCluster
from tests.e2e.cluster import save_tiny_model
from tests.e2e.test_weight_pushes import weights

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
CHUNK = 16 * 1024  # small chunks: many more than the fan-out's queue holds (the tiny model is ~350 KB)
HUNG = 120  # the trainer's deadline: reached only by a push that hangs


class HeldPush:
    """A trainer's PushWeights whose chunks after the header wait for ``release``."""

    def __init__(self, address: str, version: int, data: bytes):
        self.gate = threading.Event()
        self.channel = grpc.insecure_channel(address)
        header = common_pb2.WeightHeader(version=version, total_bytes=len(data),
                                         sha256=hashlib.sha256(data).hexdigest())

        def chunks():
            yield common_pb2.WeightChunk(header=header)
            self.gate.wait()
            for start in range(0, len(data), CHUNK):
                yield common_pb2.WeightChunk(data=data[start:start + CHUNK])
        self.call = rollout_pb2_grpc.RolloutServiceStub(self.channel).PushWeights.future(chunks(), timeout=HUNG)

    def release(self):
        """Sends the rest; returns the scheduler's answer (or raises its error)."""
        self.gate.set()
        try:
            return self.call.result()
        finally:
            self.channel.close()


def wait_for(what: str, check, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def receiving(cluster: LocalCluster, worker: str) -> bool:
    """The worker has the push's header (its weight_pushes_in_progress gauge says so)."""
    line = f'rhymerl:weight_pushes_in_progress{{component="{worker}"}} '
    return any(row.startswith(line) and float(row.split()[-1]) >= 1 for row in cluster.scrape(worker).splitlines())


def workers(client: RolloutClient) -> dict[str, tuple[bool, int]]:
    return {w.worker_id: (w.healthy, w.policy_version) for w in client.stats().workers}


def test_a_push_survives_its_worker_marked_unhealthy_and_back_and_fails_clearly_when_it_dies(tmp_path):
    """1. The SmolLM2 runs' fault, forced: the worker stops answering mid-push (SIGSTOP;
    it misses three heartbeats, it is marked unhealthy), then its heartbeat
    comes while it is still marked so (sent here, as the worker's own would be) and it
    continues. That heartbeat used to close the scheduler's channel to it, cutting the
    push's stream to the worker, after which the fan-out waited forever on that worker's
    queue and the trainer's push never returned. It completes now.
    2. The worker is killed mid-push: the trainer gets UNAVAILABLE naming it at once, the
    previous version keeps serving, the worker restarted is caught up to it, and the
    SDK's push of the same version and bytes then succeeds."""
    model = save_tiny_model(tmp_path / "model")
    with LocalCluster(model_dir=str(model), num_workers=1, log_dir=tmp_path / "logs") as cluster, \
            RolloutClient(cluster.scheduler_address, timeout_s=60, max_retries=0) as client:
        [info] = client.stats().workers
        with grpc.insecure_channel(info.address) as ch:
            stats = worker_pb2_grpc.WorkerServiceStub(ch).GetWorkerStats(worker_pb2.WorkerStatsRequest(), timeout=30)
        v1 = weights(seed=1)
        push = HeldPush(cluster.scheduler_address, 1, v1)
        wait_for("the push reaches the worker", lambda: receiving(cluster, "worker-0"))
        cluster.procs["worker-0"].send_signal(signal.SIGSTOP)
        try:
            wait_for("the worker marked unhealthy", lambda: workers(client) == {"worker-0": (False, 0)})
            with grpc.insecure_channel(cluster.scheduler_address) as ch:
                worker_pb2_grpc.RegistryServiceStub(ch).Register(worker_pb2.RegisterRequest(
                    worker_id=info.worker_id, address=info.address, policy_version=0,
                    max_num_seqs=stats.max_num_seqs, vocab_size=stats.vocab_size,
                    max_model_len=stats.max_model_len), timeout=30)
        finally:
            cluster.procs["worker-0"].send_signal(signal.SIGCONT)
        assert push.release().version == 1
        assert client.stats().policy_version == 1
        wait_for("the worker reports version 1", lambda: workers(client) == {"worker-0": (True, 1)})

        v2 = weights(seed=2)
        push = HeldPush(cluster.scheduler_address, 2, v2)
        wait_for("the push reaches the worker", lambda: receiving(cluster, "worker-0"))
        cluster.kill("worker-0")
        with pytest.raises(grpc.RpcError) as err:
            push.release()
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert "no worker took version 2" in err.value.details() and "worker-0" in err.value.details()
        assert client.stats().policy_version == 1
        cluster.restart("worker-0")  # on its initial checkpoint (version 0): caught up to version 1
        wait_for("the restarted worker caught up", lambda: workers(client) == {"worker-0": (True, 1)})
        with RolloutClient(cluster.scheduler_address, timeout_s=60, max_retries=3) as retrying:
            assert retrying.push_weights(2, v2) == 2
            assert retrying.push_weights(2, v2) == 2  # idempotent
        assert workers(client) == {"worker-0": (True, 2)}


def test_a_push_goes_on_without_a_worker_killed_mid_stream(tmp_path):
    """Two workers, one killed mid-push: the other takes the version (the fan-out no
    longer waits on the dead one's stream), and the killed one, restarted, is caught up."""
    model = save_tiny_model(tmp_path / "model")
    with LocalCluster(model_dir=str(model), num_workers=2, log_dir=tmp_path / "logs") as cluster, \
            RolloutClient(cluster.scheduler_address, timeout_s=60, max_retries=0) as client:
        push = HeldPush(cluster.scheduler_address, 1, weights(seed=1))
        wait_for("the push reaches both workers", lambda: all(receiving(cluster, w) for w in cluster.workers))
        cluster.kill("worker-1")
        answer = push.release()
        assert (answer.version, answer.num_workers_updated) == (1, 1)
        cluster.restart("worker-1")
        wait_for("the restarted worker caught up",
                 lambda: workers(client) == {"worker-0": (True, 1), "worker-1": (True, 1)})
