"""The Dockerfiles build what the chart and compose run, as a non-root user.

No Docker engine runs in CI: these read the Dockerfiles (every COPY source exists
and is not excluded by the Dockerfile's .dockerignore, the final stage runs as a
numeric non-root user, the entrypoint is the `rhymerl` CLI) and run the image's
health-check script against a real gRPC health server.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DOCKERFILES = ["Dockerfile.service", "Dockerfile.worker", "Dockerfile.worker-cpu"]


def instructions(name: str) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def final_stage(name: str) -> list[tuple[str, str]]:
    steps = instructions(name)
    last_from = max(i for i, (op, _) in enumerate(steps) if op == "FROM")
    return steps[last_from:]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; `!` re-includes."""
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if pattern == "**" or fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") \
                or fnmatch.fnmatch(path, pattern.replace("**/", "*/")):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("name", DOCKERFILES)
def test_final_stage_runs_rhymerl_as_non_root(name):
    stage = final_stage(name)
    users = [arg for op, arg in stage if op == "USER"]
    assert users, f"{name}: no USER in the final stage (it would run as root)"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root uid (Kubernetes runAsNonRoot checks it)"
    assert int(uid) == 10001, "the chart's podSecurityContext.runAsUser"
    assert ("ENTRYPOINT", '["rhymerl"]') in stage
    assert any(op == "COPY" and "deploy/healthcheck.py /usr/local/bin/rhymerl-healthcheck" in arg
               for op, arg in stage)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_copy_sources_exist_and_reach_the_build_context(name):
    patterns = [ln.strip() for ln in (DEPLOY / f"{name}.dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    for op, arg in instructions(name):
        if op != "COPY" or arg.startswith("--from"):
            continue
        *sources, _ = arg.split()
        for source in sources:
            assert (REPO / source).exists(), f"{name}: COPY {source} does not exist"
            assert not ignored(source, patterns), f"{name}: {source} is excluded by its .dockerignore"
    assert ignored(".venv", patterns) and ignored("clients/python/src/rhymerl/v1", patterns)


def test_worker_images_are_multi_stage_and_the_gpu_one_is_cuda():
    for name in ("Dockerfile.worker", "Dockerfile.worker-cpu"):
        assert sum(op == "FROM" for op, _ in instructions(name)) >= 2, name
    froms = [arg for op, arg in instructions("Dockerfile.worker") if op == "FROM"]
    assert all(f.startswith("nvidia/cuda:") for f in froms)
    assert "runtime" in froms[-1], "the final stage needs the CUDA runtime, not the toolkit"
    cpu = [arg for op, arg in instructions("Dockerfile.worker-cpu") if op in ("ARG", "RUN")]
    assert "TORCH_INDEX=https://download.pytorch.org/whl/cpu" in cpu
    assert not any("triton" in arg for arg in cpu), "triton is for GPUs"


def test_service_image_has_no_torch():
    text = " ".join(arg for _, arg in instructions("Dockerfile.service"))
    assert "torch" not in text and "[worker" not in text


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", servicer
    server.stop(None)


def healthcheck(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py"), *args],
                          capture_output=True, text=True, timeout=30)


def test_healthcheck_script_follows_the_serving_status(health_server):
    """compose healthchecks and `helm test` pass exactly when the service reports SERVING."""
    address, servicer = health_server
    servicer.set("rhymerl.v1.RolloutService", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck(address, "rhymerl.v1.RolloutService").returncode == 0
    assert healthcheck(address).returncode == 0  # the server as a whole
    servicer.set("rhymerl.v1.RolloutService", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck(address, "rhymerl.v1.RolloutService").returncode == 1
    assert healthcheck(address, "rhymerl.v1.Unknown").returncode == 1
    assert healthcheck("127.0.0.1:1").returncode == 1
    assert healthcheck().returncode == 2
