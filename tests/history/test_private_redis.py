"""A private redis-server (services/common/redis_server.py) dies with the process that
started it, however that process ends: separate OS processes, a real redis-server.

A history service killed with SIGKILL (or by the OOM killer) runs no cleanup; its
redis-server used to live on, holding memory and a temporary directory, once per restart.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.redis_server import free_port
from services.history.server import SERVICE_NAME

REPO = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0  # a bound for a busy machine, not a speed check: SIGTERM'd redis exits at once

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None if no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def redis_children(parent: int) -> list[int]:
    """Pids of the redis-server processes whose parent is ``parent``."""
    pids = []
    for path in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError):
            text = path.read_text()
            name, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
            if name == "redis-server" and int(fields[1]) == parent:
                pids.append(int(path.parent.name))
    return pids


class Watched:
    """A redis-server's pid, start time (so a reused pid is not mistaken for it) and directory."""

    def __init__(self, pid: int):
        fields = stat(pid)
        self.pid, self.start_time = pid, fields[19] if fields else None  # field 22: start time, in ticks
        self.dir = None  # its --dir, EmbeddedRedis's temporary directory
        with contextlib.suppress(OSError):
            self.dir = os.readlink(f"/proc/{pid}/cwd")
        assert self.alive(), f"redis-server {pid} is not running"

    def alive(self) -> bool:
        """Running (a zombie awaiting its reaper has exited: it holds no memory or socket)."""
        fields = stat(self.pid)
        return fields is not None and fields[19] == self.start_time and fields[0] not in ("Z", "X")

    def gone_within(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def cleanup(self) -> None:
        """What a failing test would otherwise leak: the server and its directory."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        if self.dir and Path(self.dir).name.startswith("rhymerl-redis-"):
            shutil.rmtree(self.dir, ignore_errors=True)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def serving(port: int, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
        reply = health_pb2_grpc.HealthStub(chan).Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), wait_for_ready=True, timeout=timeout_s)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING, proc.poll()


def test_a_history_service_killed_with_sigkill_takes_its_private_redis_with_it():
    """Breaks if `rhymerl history` without a Redis URL, killed by SIGKILL (no cleanup runs),
    leaves its redis-server running."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RHYMERL_HISTORY_REDIS_URL"}
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "history", "--host", "127.0.0.1", "--port",
                             str(port), "--metrics-port", "0"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    watched = None
    try:
        serving(port, proc)
        (pid,) = redis_children(proc.pid)
        watched = Watched(pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert watched.gone_within(GONE_WITHIN_S), f"redis-server {pid} outlived its killed history service"
    finally:
        kill(proc)
        if watched:
            watched.cleanup()


# Starts a private Redis from a thread that then exits (as asyncio.to_thread's workers may),
# waits until that OS thread is gone, then prints the server's pid and waits to be killed.
CHILD = """
import os, sys, threading, time
from services.common.redis_server import EmbeddedRedis

started = {}
thread = threading.Thread(target=lambda: started.setdefault("redis", EmbeddedRedis(unix=True).start()))
thread.start()
thread.join()
while os.path.exists(f"/proc/self/task/{thread.native_id}"):
    time.sleep(0.01)
print(started["redis"]._proc.pid, started["redis"].url, flush=True)
time.sleep(3600)
"""


def test_a_private_redis_outlives_the_thread_that_started_it_and_dies_with_the_process():
    """Breaks if the parent-death signal is tied to the thread that called start (the kernel
    sends it when the forking *thread* exits): the redis-server would die under a running
    service; or if the redis-server outlives its SIGKILLed process."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    watched = None
    try:
        line = proc.stdout.readline()
        assert line, f"the child exited ({proc.wait(timeout=30)}) without starting a redis-server"
        pid, url = line.split()
        watched = Watched(int(pid))
        assert int(stat(watched.pid)[1]) == proc.pid
        # The thread has exited: a signal tied to it has been sent. Give redis the time it
        # takes to act on a SIGTERM (only the old behaviour needs it: the check passes at once
        # otherwise), then check that it still serves.
        time.sleep(1.0)
        client = redis.Redis.from_url(url, socket_timeout=30)
        try:
            assert client.ping() and watched.alive()
        finally:
            client.close()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert watched.gone_within(GONE_WITHIN_S), f"redis-server {pid} outlived its killed process"
    finally:
        kill(proc)
        proc.stdout.close()
        if watched:
            watched.cleanup()


# A LocalCluster (what `make run`, the e2e tests and the chaos campaign start) spawning a
# process as it spawns its services, then waiting to be killed.
LAUNCHER = """
import sys, time
from services.local import LocalCluster

cluster = LocalCluster(model_dir="unused", log_dir=__import__("pathlib").Path(sys.argv[1]))
cluster._spawn("service", [sys.executable, "-c", "import time; time.sleep(3600)"], {})
print(cluster.procs["service"].pid, flush=True)
time.sleep(3600)
"""


def test_a_local_clusters_processes_die_with_a_launcher_killed_with_sigkill(tmp_path):
    """Breaks if LocalCluster starts its services as plain children: a `make run` or a test
    run killed with SIGKILL would leave every service running, holding its ports."""
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    pid = None
    try:
        line = proc.stdout.readline()
        assert line, f"the launcher exited ({proc.wait(timeout=30)}) without starting its process"
        pid = int(line)
        fields = stat(pid)
        assert fields is not None and int(fields[1]) == proc.pid  # its own child, the same pid after the exec
        start_time = fields[19]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + GONE_WITHIN_S
        while (f := stat(pid)) is not None and f[19] == start_time and f[0] not in ("Z", "X"):
            assert time.monotonic() < deadline, f"process {pid} outlived its killed launcher"
            time.sleep(0.05)
    finally:
        kill(proc)
        proc.stdout.close()
        if pid is not None and (f := stat(pid)) is not None and f[0] not in ("Z", "X"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
