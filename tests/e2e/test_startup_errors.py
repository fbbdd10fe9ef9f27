"""A service that cannot start says why in one line and exits; one already serving on the
port keeps it.

Real `rhymerl` processes. A second process on a port in use used to bind it too (gRPC's
Python server shares ports by default, SO_REUSEPORT) and the kernel split the
connections between the two: two history services, each with a store of its own.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.redis_server import free_port

RHYMERL = [sys.executable, "-m", "services.cli"]
ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(RHYMERL + args, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def serving(port: int, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with grpc.insecure_channel(f"localhost:{port}") as channel:
            try:
                answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
        time.sleep(0.2)
    return False


def one_error_line(stderr: str) -> str:
    """The one line that says why (log lines before it are allowed; a traceback is not)."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_a_second_service_on_a_port_in_use_exits_naming_it_and_the_first_keeps_serving():
    port = free_port()
    first = subprocess.Popen(RHYMERL + ["history", "--port", str(port), "--metrics-port", "0"], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert serving(port)
        second = run(["history", "--port", str(port), "--metrics-port", "0"])
        assert second.returncode == 1
        line = one_error_line(second.stderr)
        assert line.startswith("Error: rhymerl history could not start:") and f"0.0.0.0:{port}" in line, line
        assert "set --port (RHYMERL_HISTORY_PORT) to a free port" in line, line
        assert first.poll() is None and serving(port, 10.0)
    finally:
        first.terminate()
        first.wait(timeout=30)


def test_a_scheduler_whose_metrics_port_is_taken_says_which_and_what_to_set():
    """Two schedulers on one machine (the README's shards) once collided on the metrics
    port with "OSError: [Errno 98] Address already in use", naming neither the port nor
    the setting. (The health port's case: tests/scheduler/test_health_off_loop.py; the
    child waits for it a while, as a restarted one must.)"""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run(["scheduler", "--port", str(free_port()), "--metrics-port", str(port), "--health-port", "0",
                    "--history-address", ""])
    assert done.returncode == 1, done.stderr
    line = one_error_line(done.stderr)
    assert line == (f"Error: rhymerl scheduler could not start: could not bind the metrics port 0.0.0.0:{port}: in "
                    "use by another process; set --metrics-port (RHYMERL_SCHEDULER_METRICS_PORT) to a free port, or "
                    "0 for none"), line


@pytest.mark.parametrize("args,says", [
    (["--model-path", "/nonexistent/model"], "/nonexistent/model/config.json"),
    ([], "RHYMERL_WORKER_MODEL_PATH is required"),
])
def test_a_worker_that_cannot_load_its_model_says_why_in_one_line(args, says):
    done = run(["worker", "--metrics-port", "0", "--port", str(free_port()), *args])
    assert done.returncode == 1
    assert says in one_error_line(done.stderr)


@pytest.mark.parametrize("command,setting,value,says", [
    ("scheduler", "weights-dir", "/proc/no-such-dir", "Error: rhymerl scheduler could not start: weights_dir "
     "'/proc/no-such-dir' is not a writable directory: No such file or directory; check --weights-dir "
     "(RHYMERL_SCHEDULER_WEIGHTS_DIR)"),
    ("scheduler", "record-events", "/nonexistent/dir/events.jsonl", "Error: rhymerl scheduler could not start: "
     "record_events '/nonexistent/dir/events.jsonl' cannot be written: No such file or directory; check "
     "--record-events (RHYMERL_SCHEDULER_RECORD_EVENTS)"),
    ("router", "registry-url", "", "Error: rhymerl router could not start: the shard registry's Redis URL is "
     "required; check --registry-url (RHYMERL_ROUTER_REGISTRY_URL)"),
])
def test_a_setting_a_service_cannot_start_with_is_named_with_its_option_and_variable(command, setting, value, says):
    """A weights directory it cannot make, an events file it cannot open, a router without
    a registry: each said a bare FileNotFoundError, or the field name alone."""
    ports = ["--port", str(free_port()), "--metrics-port", "0"]
    extra = ["--health-port", "0", "--history-address", ""] if command == "scheduler" else []
    done = run([command, *ports, *extra, f"--{setting}", value])
    assert done.returncode == 1, done.stderr
    assert one_error_line(done.stderr) == says
