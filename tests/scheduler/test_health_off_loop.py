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
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.control_plane import SchedulerProcess
from benchmarks.fake_fleet import FakeFleet, FleetSpec
from services.common.health_process import HealthProcess
from services.common.redis_server import free_port
from tests.aio import run_async

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
ROLLOUT = "rhymerl.v1.RolloutService"
ROOT = Path(__file__).resolve().parents[2]


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


@run_async
async def test_a_taken_health_port_is_a_bind_error_naming_the_port_and_its_setting():
    """What the command line turns into one line naming --health-port and its variable
    (services/cli.py); the child logs no gRPC bind error per attempt while it waits."""
    from services.common.errors import BindError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        health = HealthProcess("127.0.0.1", port, ["", ROLLOUT], stall_s=0, bind_wait_s=0)
        with pytest.raises(BindError) as err:
            await health.start()
    assert err.value.setting == "health_port"
    assert str(err.value) == f"could not bind the health port 127.0.0.1:{port}: in use by another process"
    assert health.proc is None


@run_async
async def test_a_health_process_that_dies_as_its_service_stops_is_not_restarted(caplog):
    health = HealthProcess("127.0.0.1", 0, ["", ROLLOUT], stall_s=0, tick_s=0.05)
    await health.start()
    try:
        health.stopping()
        old = health.proc
        old.kill()
        await asyncio.to_thread(old.wait)
        while not health._ticker.done():  # it notices, and ends instead of starting another
            await asyncio.sleep(0.05)
        assert health.proc is None
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    finally:
        await health.stop()


@pytest.mark.slow
def test_sigterm_to_the_schedulers_process_group_stops_it_cleanly(tmp_path):
    """`kill -TERM -PGID` (a shell's job control, a supervisor, `timeout`) reaches the
    scheduler and its health process at once. The health process used to die first and
    the scheduler, still draining, logged an ERROR and started another one. Now the child
    ignores the signal and ends when the scheduler closes its pipe; the scheduler exits 0
    with no error and no restart in its log. A Watch stream kept open on the gRPC port
    makes the drain last its whole grace period (health ticks included)."""
    port, health_port = free_port(), free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RHYMERL_SCHEDULER_HOST": "127.0.0.1",
           "RHYMERL_SCHEDULER_PORT": str(port), "RHYMERL_SCHEDULER_HEALTH_PORT": str(health_port),
           "RHYMERL_SCHEDULER_METRICS_PORT": "0", "RHYMERL_SCHEDULER_HISTORY_ADDRESS": "",
           "RHYMERL_SCHEDULER_REDIS_URL": ""}
    log_path = tmp_path / "scheduler.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.cli", "scheduler"], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("the scheduler serves", lambda: proc.poll() is None and answers(f"127.0.0.1:{health_port}", "",
                                                                              SERVING), timeout_s=120)
        [child] = children(proc.pid)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=120)
            assert next(watch).status == SERVING  # the stream is open
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=120) == 0, log_path.read_text()
        text = log_path.read_text()
        assert "shutting down" in text, text
        assert " ERROR " not in text and "starting it again" not in text and "Traceback" not in text, text
        wait_for("the health process ended too", lambda: not Path(f"/proc/{child}").exists()
                 or Path(f"/proc/{child}/stat").read_text().split(") ", 1)[1].startswith("Z"))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_health_process_whose_service_stopped_while_it_started_ends_quietly():
    """The service gone before the child said "ready" (a scheduler stopped during its
    start): the child ends with status 0 and nothing on stderr, where it left a
    BrokenPipeError traceback in the service's log."""
    child = subprocess.Popen([sys.executable, "-m", "services.common.health_process", "--host", "127.0.0.1",
                              "--port", "0", "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, cwd=Path(__file__).resolve().parents[2])
    child.stdout.close()  # the service's end of the pipe, closed before the child writes to it
    _, err = child.communicate(timeout=120)
    assert child.returncode == 0 and err == b"", err.decode()
