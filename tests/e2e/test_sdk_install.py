"""The README's SDK line works on a fresh clone: the SDK built from a clean copy of
clients/python (no generated code in it) as an sdist, then a wheel from that sdist,
installs into an empty virtualenv with grpcio, protobuf and numpy only (no torch), and
rolls out a step against a live server through it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, save_tiny_model

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

CLIENT = """
import json, sys
import rhymerl
from rhymerl import Prompt, RolloutClient, SamplingParams
with RolloutClient(sys.argv[1], timeout_s=120) as client:
    result = client.rollout("sdk-wheel", [Prompt("q0", [3, 5, 7]), Prompt("q1", [4, 6])], n=2,
                            sampling=SamplingParams(temperature=1.0, max_tokens=8, seed=1))
print(json.dumps({"sdk": rhymerl.__file__, "keys": sorted([s.prompt_id, s.sample_index] for s in result.samples),
                  "logprobs": all(len(s.logprobs) == len(s.token_ids) > 0 for s in result.samples)}))
"""


def _run(*args, cwd=None) -> str:
    proc = subprocess.run([str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{args}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def clean_clone(dest: Path) -> Path:
    """clients/python and protos/ as a fresh clone has them: no generated code, no build output."""
    shutil.copytree(REPO / "protos", dest / "protos")
    shutil.copytree(REPO / "clients" / "python", dest / "clients" / "python",
                    ignore=shutil.ignore_patterns("v1", "*.egg-info", "build", "dist", "__pycache__"))
    sdk = dest / "clients" / "python"
    assert not (sdk / "src" / "rhymerl" / "v1").exists()
    return sdk


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("sdk")
    sdk = clean_clone(tmp / "clone")
    # PEP 517 calls, as `python -m build --no-isolation` makes them (this interpreter has
    # setuptools and grpcio-tools, the build requirements): clone -> sdist -> wheel.
    sdist = _run(sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp)!r}))",
                 cwd=sdk).split()[-1]
    shutil.rmtree(sdk.parent.parent / "protos")  # the wheel must come from the sdist's own copy
    unpacked = tmp / "unpacked"
    shutil.unpack_archive(tmp / sdist, unpacked)
    (source,) = unpacked.iterdir()
    shutil.rmtree(source / "src" / "rhymerl" / "v1", ignore_errors=True)
    name = _run(sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.build_wheel({str(tmp)!r}))",
                cwd=source).split()[-1]
    return tmp / name


def test_wheel_holds_the_generated_code_and_its_runtime_requirements(wheel):
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith("METADATA"))).decode()
    for proto in ("common", "rollout", "worker", "history"):
        assert f"rhymerl/v1/{proto}_pb2.py" in names and f"rhymerl/v1/{proto}_pb2_grpc.py" in names
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert sorted(r.split("<")[0].split(">")[0] for r in requires) == ["grpcio", "numpy", "protobuf"]


def test_wheel_in_an_empty_virtualenv_calls_a_live_server(wheel, tmp_path, redis_url):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # this pip installs into it (--python): faster
    python = env_dir / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check"]
    _run(*pip, "install", "-q", wheel)
    installed = {line.split("==")[0].lower() for line in _run(*pip, "freeze", "--all").split()}
    assert "torch" not in installed and {"rhymerl", "grpcio", "protobuf", "numpy"} <= installed
    cluster = Cluster(model_dir=save_tiny_model(tmp_path / "model"), redis_url=redis_url, num_workers=1).start()
    try:
        out = json.loads(_run(python, "-c", CLIENT, cluster.address, cwd=tmp_path).splitlines()[-1])
    finally:
        cluster.stop()
    assert out["sdk"].startswith(str(env_dir))  # the installed wheel, not the repository's source
    assert out["keys"] == [["q0", 0], ["q0", 1], ["q1", 0], ["q1", 1]] and out["logprobs"]
