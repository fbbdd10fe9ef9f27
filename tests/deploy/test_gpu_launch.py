"""No GPU run reports success having measured nothing.

If these fail, a GPU window could end with "exit 0" and empty results: a benchmark that
found no CUDA, or a test tier whose every test skipped, would look like a success."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "deploy" / "gpu"))

import launch  # noqa: E402  (deploy/gpu/launch.py, a script)

no_cuda = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA exits")


@no_cuda
def test_gpu_benchmarks_without_cuda_exit_non_zero_with_one_line(monkeypatch, capsys, tmp_path):
    from benchmarks import e2e_bench, engine_bench, kernels_bench

    with pytest.raises(SystemExit) as stop:
        engine_bench.main(["--device", "cuda", "--out", str(tmp_path)])
    assert "no CUDA device" in str(stop.value.code) and "nothing measured" in str(stop.value.code)
    monkeypatch.setattr(sys, "argv", ["kernels_bench", "--out", str(tmp_path)])
    assert kernels_bench.main() == 1
    assert e2e_bench.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())  # nothing written
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all("nothing measured" in line for line in err)


class HostRuntime:
    def env(self) -> dict[str, str]:
        return {**os.environ, "PYTHONPATH": str(ROOT)}


def run_tier(tmp_path: Path, monkeypatch, body: str) -> dict:
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / "test_tier.py").write_text("import pytest\n\n" + body)
    out = tmp_path / "out"
    out.mkdir()
    (out / "device.json").write_text(json.dumps({"device": "Test GPU"}))
    # --rootdir: the test names in the report are relative to it; without it pytest takes
    # the common ancestor of the tier and the working directory (the checkout), which
    # depends on where the checkout lives
    monkeypatch.setitem(launch.MODES, "test", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                               "-o", "addopts=", "--rootdir", str(tmp_path / "tier"),
                                               str(tmp_path / "tier")])
    launch.run("test", HostRuntime(), out, [])
    return json.loads((out / "gpu_tests.json").read_text())


def test_the_test_tier_reports_each_test_and_its_device(tmp_path, monkeypatch):
    summary = run_tier(tmp_path, monkeypatch, "def test_a():\n    pass\n\n\ndef test_b():\n    pytest.skip('no')\n")
    assert (summary["device"], summary["passed"], summary["skipped"], summary["failed"]) == ("Test GPU", 1, 1, 0)
    assert [t["outcome"] for t in summary["tests"]] == ["passed", "skipped"]
    assert "| test_tier::test_a | passed |" in (tmp_path / "out" / "gpu_tests.md").read_text()


def test_a_tier_that_ran_no_test_is_a_failure(tmp_path, monkeypatch):
    with pytest.raises(launch.NotReady, match="ran no test"):
        run_tier(tmp_path, monkeypatch, "def test_a():\n    pytest.skip('needs a CUDA GPU')\n")


def test_a_failing_tier_is_a_failure(tmp_path, monkeypatch):
    with pytest.raises(launch.NotReady, match="exit 1"):
        run_tier(tmp_path, monkeypatch, "def test_a():\n    assert False\n")
