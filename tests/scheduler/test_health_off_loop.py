"""Liveness and readiness answered off the scheduler's event loop (services/common/health_process.py).

The real `rhymerl scheduler` process with one fake worker over loopback gRPC: stopped
outright (SIGSTOP: its event loop, every thread of it, cannot answer anything), its
health port still answers, and truly; readiness follows the fleet; a killed scheduler
leaves nothing answering. The stall rule (liveness fails once the loop stops turning)
on a HealthProcess whose ticks stop. Every wait is on a state, with a hang guard; no
assertion on speed: a check that waited for the stopped loop would never return, so
"answers at all" is the property."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.control_plane import SchedulerProcess
from benchmarks.fake_fleet import FakeFleet, FleetSpec
from services.common.health_process import HealthProcess
from tests.aio import run_async

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
ROLLOUT = "rhymerl.v1.RolloutService"


def check(address: str, service: str = "", timeout_s: float = 30.0) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=timeout_s).status


def wait_for(what: str, predicate, timeout_s: float = 60.0) -> None:
    """A hang guard, not a speed assertion."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def answers(address: str, service: str, status: int) -> bool:
    try:
        return check(address, service, timeout_s=5) == status
    except grpc.RpcError:
        return False


def children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]


@pytest.mark.slow
def test_health_answers_truly_while_the_scheduler_is_stopped_and_dies_with_it(tmp_path):
    sched = SchedulerProcess("rhymerl", tmp_path / "scheduler.log", {"RHYMERL_SCHEDULER_HEARTBEAT_S": "0.2",
                                                                      "RHYMERL_SCHEDULER_LIVENESS_STALL_S": "0"})
    fleet = None
    try:
        sched.wait_serving()
        health = sched.health_address
        assert check(health, "") == SERVING
        assert check(health, ROLLOUT) == NOT_SERVING  # no worker yet: unready
        fleet = FakeFleet(FleetSpec(sched.address, 1, per_process=1)).start()
        wait_for("ready once a worker registered", lambda: answers(health, ROLLOUT, SERVING))

        sched.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(grpc.RpcError) as err:  # the loop cannot answer: the test's premise
                check(sched.address, "", timeout_s=1)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert check(health, "") == SERVING  # answered while the scheduler cannot run at all
            assert check(health, ROLLOUT) == SERVING
            assert check(health, "rhymerl.v1.RegistryService") == SERVING
        finally:
            sched.proc.send_signal(signal.SIGCONT)

        fleet.stop()  # its only worker gone: three missed beats later, unready
        fleet = None
        wait_for("unready once the worker died", lambda: answers(health, ROLLOUT, NOT_SERVING))
        assert check(health, "") == SERVING

        [child] = children(sched.proc.pid)
        sched.proc.kill()
        sched.proc.wait()
        wait_for("the health process ends with the scheduler", lambda: not Path(f"/proc/{child}").exists()
                 or Path(f"/proc/{child}/stat").read_text().split(") ", 1)[1].startswith("Z"))
        with pytest.raises(grpc.RpcError) as err:
            check(health, "", timeout_s=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        if fleet is not None:
            fleet.stop()
        sched.stop()


@run_async
async def test_liveness_fails_once_the_loop_stops_turning_and_a_dead_health_process_is_restarted():
    health = HealthProcess("127.0.0.1", 0, ["", ROLLOUT], stall_s=1.0, tick_s=0.05)
    port = await health.start()
    address = f"127.0.0.1:{port}"

    async def until(what: str, service: str, status: int) -> None:  # what: read when the hang guard fires
        while not await asyncio.to_thread(answers, address, service, status):
            await asyncio.sleep(0.05)

    try:
        await until("nothing published yet", ROLLOUT, NOT_SERVING)
        health.set("", True)
        health.set(ROLLOUT, True)
        await until("published", ROLLOUT, SERVING)
        health._ticker.cancel()  # the loop stops turning: no more ticks
        await until("the stall", "", NOT_SERVING)
        assert await asyncio.to_thread(check, address, ROLLOUT) == NOT_SERVING
        health._publish()  # it turns again
        await until("live again", "", SERVING)
        assert await asyncio.to_thread(check, address, ROLLOUT) == SERVING

        health._ticker = asyncio.create_task(health._tick())
        old = health.proc
        old.kill()
        await asyncio.to_thread(old.wait)
        while health.proc is old or health.proc is None:  # the ticker notices and starts another
            await asyncio.sleep(0.05)
        assert health.port == port
        await until("the new process answers as published", ROLLOUT, SERVING)
    finally:
        proc = health.proc
        await health.stop()
        assert proc is None or proc.poll() is not None
