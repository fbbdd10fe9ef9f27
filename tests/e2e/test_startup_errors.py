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


def broken_checkpoint(folder: Path, how: str) -> Path:
    """A small checkpoint broken one way: its weights cut short, or its config.json not JSON."""
    from services.rollout.loader import init_random_model, save_model
    from services.rollout.models.config import ModelConfig

    config = ModelConfig(architecture="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
                         tie_word_embeddings=True, attention_bias=False, qk_norm=False, eos_token_ids=(2,),
                         bos_token_id=None, dtype="float32")
    save_model(init_random_model(config, seed=0), folder)
    if how == "truncated":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:1000])
    else:
        (folder / "config.json").write_text('{"hidden_size": ')
    return folder


@pytest.mark.parametrize("args,says", [
    (["--model-path", "/nonexistent/model"], "/nonexistent/model/config.json"),
    ([], "a checkpoint directory is required; check --model-path (RHYMERL_WORKER_MODEL_PATH)"),
    # these said a bare "SafetensorError: Error while deserializing header: ..." and
    # "JSONDecodeError: Expecting value: ...", naming neither the file nor the setting
    (["--model-path", "{truncated}"], "{truncated}/model.safetensors: Error while deserializing header"),
    (["--model-path", "{bad-json}"], "{bad-json}/config.json: Expecting value"),
])
def test_a_worker_that_cannot_load_its_model_says_why_in_one_line(args, says, tmp_path):
    folders = {how: str(broken_checkpoint(tmp_path / how, how)) for how in ("truncated", "bad-json")
               if "{" + how + "}" in " ".join(args)}
    args, says = [a.format(**folders) for a in args], says.format(**folders)
    done = run(["worker", "--metrics-port", "0", "--port", str(free_port()), "--device", "cpu", *args])
    assert done.returncode == 1
    line = one_error_line(done.stderr)
    assert says in line, line
    assert line.endswith("check --model-path (RHYMERL_WORKER_MODEL_PATH)"), line


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a CUDA device")
def test_a_worker_told_to_use_a_cuda_device_this_machine_lacks_names_the_setting():
    """It said "AssertionError: Torch not compiled with CUDA enabled", naming no setting."""
    done = run(["worker", "--metrics-port", "0", "--port", str(free_port()), "--device", "cuda:0",
                "--model-path", "/nonexistent/model"])
    assert done.returncode == 1
    line = one_error_line(done.stderr)
    assert "device 'cuda:0': PyTorch sees 0 CUDA device(s)" in line, line
    assert line.endswith("check --device (RHYMERL_WORKER_DEVICE)"), line


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
