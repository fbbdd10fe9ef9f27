"""The GPU run rehearsed here: the bundle, built by the same script for this machine's
Python, installs without network into a Python that holds exactly the GPU image's packages,
and everything the GPU run needs imports from it.

If this fails, the first command on the rarely lent GPU machine would fail on a missing
package, a generated-code version clash or a redis-server that does not start, and the
GPU window would be spent debugging the environment instead of measuring.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import tarfile
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "deploy" / "gpu"
HERE = f"{sys.version_info.major}.{sys.version_info.minor}"

pytestmark = pytest.mark.slow


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages() -> set[str]:
    lines = (line.split("#", 1)[0] for line in (GPU / "image_packages.txt").read_text().splitlines())
    return {canonical(name) for line in lines for name in line.split()}


def is_namespace(path: Path) -> bool:
    return path.is_dir() and "." not in path.name and not (path / "__init__.py").exists()


def with_dependencies(names: set[str], site: Path) -> set[str]:
    """`names` and, recursively, what their copies here require (the image's packages come
    with their own dependencies, whose names can differ between versions: this machine's
    huggingface-hub needs httpx2, the image's httpx)."""
    from packaging.requirements import Requirement

    dists = {canonical(d.metadata["Name"]): d for d in importlib.metadata.distributions(path=[str(site)])}
    wanted, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name in wanted:
            continue
        wanted.add(name)
        for line in (dists[name].requires or []) if name in dists else []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonical(req.name))
    return wanted


def gpu_like_python(root: Path) -> Path:
    """A venv whose site-packages holds links to this environment's copies of exactly the
    GPU image's packages (torch, triton, transformers, grpcio, protobuf, pytest, ...):
    the GPU machine's `python3`, as far as names go (versions are this machine's)."""
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(root)],
                   check=True)
    site = Path(sysconfig.get_paths(vars={"base": str(root), "platbase": str(root)})["purelib"])
    ours = Path(sysconfig.get_paths()["purelib"])
    wanted = with_dependencies(image_packages(), ours)
    for dist in importlib.metadata.distributions(path=[str(ours)]):
        if canonical(dist.metadata["Name"]) not in wanted:
            continue
        for parts in {f.parts[:2] for f in dist.files or []}:
            top = parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth") or not (ours / top).exists():
                continue
            if len(parts) == 2 and is_namespace(ours / top):
                (site / top).mkdir(exist_ok=True)  # shared with other distributions (google/): this one's part
                top = "/".join(parts)
            if not os.path.lexists(site / top):
                (site / top).symlink_to(ours / top)
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "gpu-bundle"
    subprocess.run([sys.executable, str(GPU / "bundle.py"), "--python", HERE, "--out", str(out)], check=True,
                   timeout=600)
    return out


def offline(command: list[str], loopback: bool = False) -> list[str]:
    """The command in a namespace with no network when this machine allows it (pip runs
    with --no-index either way); with `loopback`, the namespace's loopback is up (the GPU
    machine has one: the services talk over it)."""
    if shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0:
        if not loopback:
            return ["unshare", "-n", *command]
        if shutil.which("ip") and subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"],
                                                 capture_output=True).returncode == 0:
            return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *command]
    return command


def launch(python: Path, mode: str, bundle: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(offline([str(python), str(GPU / "launch.py"), mode, "--bundle", str(bundle),
                                   "--site", str(site)]), capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_bundle_installs_offline_and_everything_imports(bundle, tmp_path):
    """`launch.py check` in the GPU-like Python: the wheels install with no index, every
    module of services/, kernels/, benchmarks/ and the SDK (with the bundle's generated
    gRPC code) imports, the GPU test tier collects, the bundled redis-server runs. Without
    CUDA, the GPU modes stop at once with one line that says so."""
    python = gpu_like_python(tmp_path / "gpu-python")
    # Both compiled libraries travel in it (the drafter core, the CPU sampler's RNG).
    files = json.loads((bundle / "manifest.json").read_text())["files"]
    assert {"lib/libhisto.so", "lib/libgumbel.so", "lib/libattention.so"} <= set(files)
    # The GPU-like Python really lacks what the bundle brings.
    probe = subprocess.run([str(python), "-c", "import redis"], capture_output=True, text=True)
    assert probe.returncode != 0 and "redis" in probe.stderr

    check = launch(python, "check", bundle, tmp_path / "site")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "environment complete" in check.stdout
    assert (tmp_path / "site" / "rhymerl" / "v1" / "rollout_pb2_grpc.py").exists()

    test = launch(python, "test", bundle, tmp_path / "site")
    assert test.returncode == 2
    assert test.stderr.strip().splitlines() == [
        "gpu test: NOT DONE: no CUDA device: torch " + test.stderr.split("torch ", 1)[1].split(" ", 1)[0]
        + " sees none (torch.cuda.is_available() is False)"]


def test_a_package_missing_from_the_bundle_is_named(bundle, tmp_path):
    """Drop redis-py from the bundle: the check fails, naming the package and who needs it."""
    partial = tmp_path / "partial"
    shutil.copytree(bundle, partial)
    for wheel in (partial / "wheels").glob("redis-*.whl"):
        wheel.unlink()
    python = gpu_like_python(tmp_path / "gpu-python")
    check = launch(python, "check", partial, tmp_path / "site")
    assert check.returncode == 2
    assert "package 'redis'" in check.stderr.strip().splitlines()[-1]


def test_the_bundled_redis_server_serves_the_history_store(bundle, monkeypatch):
    """The redis-server taken from the wheel runs here (the GPU machine is x86-64 Linux too)
    and has what the history store's scripts use (ZRANGE ... REV: Redis >= 6.2)."""
    import redis

    from services.common.redis_server import EmbeddedRedis

    monkeypatch.setenv("PATH", f"{bundle / 'bin'}:/nonexistent")
    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
        client.zadd("epochs", {"a": 1, "b": 2})
        assert client.zrange("epochs", 0, -1, desc=True) == [b"b", b"a"]
        assert client.info("server")["redis_version"] == "6.2.14"
        client.close()


def test_the_campaign_rehearses_every_part_on_the_cpu(bundle, tmp_path):
    """`launch.py campaign --dry-run` in the GPU-like Python, offline: the environment
    check, then each part of the GPU window (engine steps, the cost probe, the speedup
    sweep over a policy widened to a tiny shape, e2e with widened pushes, the GPU tier)
    on the CPU with tiny shapes, and the drafter's host replays beside the cost probe; every
    part's results reach --copy-to, marked dry runs.
    If this fails, the one call of the next GPU window would fail the same way."""
    from benchmarks.tiny_llm import train_sft
    from services.rollout.loader import init_random_model

    micro = dataclasses.replace(train_sft.PRESETS["tiny"], hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    train_sft.save_checkpoint(init_random_model(train_sft.model_config(micro), seed=0), tmp_path / "micro")
    python = gpu_like_python(tmp_path / "gpu-python")
    done = subprocess.run(offline([str(python), str(GPU / "launch.py"), "campaign", "--dry-run", "--budget-s", "1500",
                                   "--bundle", str(bundle), "--site", str(tmp_path / "site"), "--model-dir",
                                   str(tmp_path / "micro"), "--out", str(tmp_path / "out"), "--copy-to",
                                   str(tmp_path / "copy")], loopback=True), capture_output=True, text=True,
                          timeout=1600, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(list((tmp_path / "copy").iterdir())) <= 7  # the device tool returns 8 files, the log is one
    with tarfile.open(tmp_path / "copy" / "results.tgz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    assert json.loads((tmp_path / "back" / "campaign.json").read_text()) == \
        json.loads((tmp_path / "copy" / "campaign.json").read_text())
    record = json.loads((tmp_path / "back" / "campaign.json").read_text())
    assert [(p["name"], p["status"]) for p in record["parts"]] == [
        ("gpu_check", "done"), ("engine_steps", "done"), ("cost_probe", "done"), ("drafter_host", "done"),
        ("spec_sweep", "done"), ("e2e", "done"), ("gpu_tests", "done")], done.stdout[-4000:]
    # beside the cost probe: the compiled drafter's replays on this CPU, from the bundle's Python
    host = json.loads((tmp_path / "back" / "drafter_host.json").read_text())
    assert host["rounds"] == 1 and all(r["drafts_different_from_recorded"] == 0
                                       for r in host["replays"][0]["compiled"])
    for name in ("engine_steps", "cost_probe", "spec_sweep"):
        assert json.loads((tmp_path / "back" / f"{name}.json").read_text())["dry_run"] is True
    sweep = json.loads((tmp_path / "back" / "spec_sweep.json").read_text())
    assert {(r["stop"], r["drafter"]) for r in sweep["rows"]} == {
        ("EOS", "plain"), ("EOS", "history"), ("EOS", "history-tree"), ("max", "plain"), ("max", "oracle 1.5"),
        ("max", "oracle 2.5")}
    assert all(r["identical_share"] == 1.0 for r in sweep["rows"])  # speculation and widening are lossless
    assert all(r["cut_reached"] >= 0.8 for r in sweep["rows"] if r["cut"] is not None)  # the oracle reaches its cut
    e2e = json.loads((tmp_path / "back" / "e2e.json").read_text())
    assert e2e["model_shape"]["widened"] and e2e["model_shape"]["hidden_size"] == 64 and e2e["aborted"] == 0
