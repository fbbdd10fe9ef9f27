"""Restarts as a cluster does them: the scheduler crashes and comes back, readiness
while nothing can serve. In-process services on real gRPC (the kill -9 of real
processes is in test_local_processes.py and the chaos campaign)."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rhymerl import RolloutClient, SamplingParams

from services.scheduler.watchdog import MIN_SHARE, MISSED_BEATS
from tests.e2e.cluster import Cluster, prompts

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, seed=1)


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    """A hang guard, not a speed assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(0.05)


def health(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10).status


def test_a_restarted_scheduler_gets_its_fleet_back(model_dir, redis_url):
    """kill -9 of the scheduler: the workers notice and register with the new one, so
    the trainer's next submission is served instead of UNAVAILABLE forever."""
    c = Cluster(model_dir=model_dir, redis_url=redis_url).start()
    try:
        with RolloutClient(c.address, timeout_s=60, max_retries=0) as client:
            before = client.rollout("before-crash", prompts(2), n=2, sampling=GREEDY)
        c.crash_scheduler()
        c.start_scheduler()
        workers = c.scheduler.core.workers
        wait_for(lambda: len(workers.usable()) == 2, "re-registration")
        with RolloutClient(c.address, timeout_s=60, max_retries=0) as client:
            after = client.rollout("after-crash", prompts(2), n=2, sampling=GREEDY)
        assert {s.key: s.token_ids for s in after.samples} == {s.key: s.token_ids for s in before.samples}
    finally:
        c.stop()


def test_a_default_client_rides_through_a_scheduler_restart_mid_step(model_dir, redis_url, caplog):
    """The scheduler killed while a step streams and back 3 s later, as a pod Kubernetes
    replaces: the SDK's default client re-sends until it answers again (retry_window_s)
    and its step's samples come once each. Its old default, 3 re-sends within about
    1.4 s, gave the trainer UNAVAILABLE while the new scheduler was starting."""
    c = Cluster(model_dir=model_dir, redis_url=redis_url).start()
    sampling = SamplingParams(temperature=1.0, max_tokens=48, seed=5, ignore_eos=True)
    try:
        with RolloutClient(c.address, timeout_s=60) as client:
            samples = iter(client.submit_step("through-restart", prompts(4), n=4, sampling=sampling))
            first = next(samples)  # the step is running
            c.crash_scheduler()
            time.sleep(3.0)  # down: every re-send meanwhile is UNAVAILABLE
            c.start_scheduler()
            rest = list(samples)
        keys = [s.key for s in [first, *rest]]
        assert len(keys) == 16 and len(set(keys)) == 16, keys
        assert all(len(s.token_ids) == 48 and not s.error for s in [first, *rest])
        assert any("sending it again" in r.getMessage() for r in caplog.records if r.name == "rhymerl")
    finally:
        c.stop()


def test_scheduler_readiness_says_whether_a_worker_can_serve(model_dir, redis_url):
    """RolloutService is NOT_SERVING while no worker is registered (a trainer's call could
    only fail), SERVING once one is; the process itself stays live ("")."""
    c = Cluster(model_dir=model_dir, redis_url=redis_url, num_workers=0).start()
    try:
        assert health(c.address, "rhymerl.v1.RolloutService") == health_pb2.HealthCheckResponse.NOT_SERVING
        assert health(c.address, "") == health_pb2.HealthCheckResponse.SERVING
        c.run(c.add_worker("w0"))
        wait_for(lambda: health(c.address, "rhymerl.v1.RolloutService") == health_pb2.HealthCheckResponse.SERVING,
                 "readiness after a worker registered")
        c.kill_worker("w0")
        # The watchdog's own bound: silence counts at least MIN_SHARE of each round, so a
        # scheduler whose rounds run late on a loaded machine still loses a silent worker
        # within MISSED_BEATS beats / MIN_SHARE (60 s at the cluster's 1 s beat); the hang
        # guard must outlast that bound, not equal it (CI once saw 60 s pass without it).
        bound_s = MISSED_BEATS * 1.0 / MIN_SHARE
        wait_for(lambda: health(c.address, "rhymerl.v1.RolloutService")
                 == health_pb2.HealthCheckResponse.NOT_SERVING, "unreadiness after the worker died", bound_s + 30)
    finally:
        c.stop()
