"""No GPU run reports success having measured nothing.

If these fail, a GPU window could end with "exit 0" and empty results: a benchmark that
found no CUDA, or a test tier whose every test skipped, would look like a success."""

from __future__ import annotations

import json
import tarfile
import os
import sys
import time
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


# ---------------------------------------------------------------- the campaign (one GPU window)

SLOW_PART = """
import pathlib, signal, sys, time
out = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])
(out / 'slow.json').write_text('{"rows": 1}')
signal.signal(signal.SIGTERM, lambda *a: ((out / 'slow_stopped').write_text('kept'), sys.exit(143)))
print('ready', flush=True)
while True:
    time.sleep(0.05)
"""
FAST_PART = "import pathlib, sys; pathlib.Path(sys.argv[sys.argv.index('--out') + 1], 'fast.json').write_text('{}')"


def test_each_part_ends_by_its_deadline_keeps_its_results_and_later_parts_run(tmp_path):
    """A part that overruns its slice is asked to stop (SIGTERM: it writes what it has) and
    the campaign goes on; a part whose slice has passed is skipped, not started late; each
    part's files reach --copy-to as soon as it ends; campaign.json records every part."""
    out, copy = tmp_path / "out", tmp_path / "copy"
    out.mkdir()
    (out / "device.json").write_text(json.dumps({"device": "Test GPU"}))
    parts = [launch.Part("slow", ["-c", SLOW_PART], ends_at=0.03, min_s=1),
             launch.Part("fast", ["-c", FAST_PART], ends_at=0.6, min_s=1),
             launch.Part("late", ["-c", FAST_PART], ends_at=0.0, min_s=1)]
    record = launch.campaign(HostRuntime(), out, 100.0, time.monotonic(), copy, parts=parts)
    assert [(p["name"], p["status"]) for p in record["parts"]] == [("slow", "cut"), ("fast", "done"),
                                                                    ("late", "skipped")]
    assert (out / "slow_stopped").read_text() == "kept"
    assert record["parts"][0]["files"] == ["slow.json", "slow_stopped"]
    # what comes back from the device tool (at most 8 files): the summary and one archive of everything
    assert sorted(p.name for p in copy.iterdir()) == ["campaign.json", "campaign.md", "device.json", "results.tgz"]
    with tarfile.open(copy / "results.tgz") as tar:
        assert sorted(tar.getnames()) == ["campaign.json", "campaign.md", "device.json", "fast.json", "slow.json",
                                          "slow_stopped"]
    assert json.loads((copy / "campaign.json").read_text())["parts"] == record["parts"]
    assert record["parts"][1]["command"].startswith("python3 -c ")


@pytest.mark.slow
def test_a_test_tier_cut_by_its_deadline_reports_what_ran(tmp_path):
    """pytest stopped by SIGINT at the deadline still writes its report: the tests that ran
    are in gpu_tests.json, marked as interrupted; also when the launcher itself runs with
    SIGINT ignored (started with `&` by a non-interactive shell, as a device tool may: the
    part must not inherit that). The slice is 30 s: pytest must start and pass test_a
    before the cut."""
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / "test_tier.py").write_text(
        "import pathlib, time\n\ndef test_a():\n    pass\n\n\ndef test_hangs():\n"
        f"    pathlib.Path({str(tmp_path / 'hanging')!r}).touch()\n    while True:\n        time.sleep(0.05)\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "device.json").write_text(json.dumps({"device": "Test GPU"}))
    tier = launch.Part("gpu_tests", ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--rootdir",
                                     str(tmp_path / "tier"), str(tmp_path / "tier")], ends_at=0.3,
                       stop=launch.signal.SIGINT, out_flag=False, min_s=1)
    class BundleRuntime(HostRuntime):  # the GPU machine's: the bundle's commit in the parts' env only
        def env(self) -> dict[str, str]:
            return {**super().env(), "RHYMERL_COMMIT": "abc1234"}

    previous = launch.signal.signal(launch.signal.SIGINT, launch.signal.SIG_IGN)
    try:
        record = launch.campaign(BundleRuntime(), out, 100.0, time.monotonic(), None, parts=[tier])
    finally:
        launch.signal.signal(launch.signal.SIGINT, previous)
    assert (tmp_path / "hanging").exists()
    assert record["parts"][0]["status"] == "cut" and record["parts"][0]["tests"]["passed"] == 1
    summary = json.loads((out / "gpu_tests.json").read_text())
    assert summary["interrupted"] and [t["name"] for t in summary["tests"]][0] == "test_tier::test_a"
    assert summary["commit"] == "abc1234"  # the bundle's, not the (stale) checkout's on the GPU machine


def test_results_record_the_bundles_commit_and_repository_relative_commands(tmp_path):
    """What a GPU run writes is ready to commit: the commit is the bundle's as it is (no
    note appended), and commands name the repository's paths relative to its root."""
    from gpu_runtime import GPURuntime

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.json").write_text(json.dumps(
        {"python": f"{sys.version_info.major}.{sys.version_info.minor}", "commit": "abc1234", "files": {}}))
    assert GPURuntime(bundle).env()["RHYMERL_COMMIT"] == os.environ.get("RHYMERL_COMMIT", "abc1234")
    assert launch.shown([sys.executable, "-m", "benchmarks.e2e_bench", "--out",
                         str(ROOT / "benchmarks/results/test-gpu"), "--junitxml", "/tmp/x.xml"]) == \
        "python3 -m benchmarks.e2e_bench --out benchmarks/results/test-gpu"


@no_cuda
def test_every_campaign_part_parses_its_arguments_and_without_cuda_says_so(tmp_path, capsys):
    """The campaign's commands, exactly as the GPU window runs them: each parses and, with no
    CUDA device, ends with one line and writes nothing (a typo in an argument would otherwise
    cost a part of the window)."""
    from benchmarks import cost_probe, e2e_bench, engine_steps, spec_sweep

    mains = {"benchmarks.engine_steps": engine_steps.main, "benchmarks.cost_probe": cost_probe.main,
             "benchmarks.spec_sweep": spec_sweep.main, "benchmarks.e2e_bench": e2e_bench.main}
    for part in [p for p in launch.CAMPAIGN if p.name not in launch.TEST_PARTS]:
        argv = part.args[2:] + ["--out", str(tmp_path)] + (["--budget-s", "60"] if part.name == "e2e" else [])
        assert mains[part.args[1]](argv) == 2, part.name
    assert not list(tmp_path.iterdir())
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all("no CUDA device" in line and "nothing measured" in line for line in err)


def test_the_gpu_check_names_tests_that_exist():
    """The campaign's first part names test node ids: a renamed test would leave the part
    running nothing (pytest exits 4 on an unknown id), which only the GPU window would show."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *launch.GPU_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(collected) >= 10 and any("test_widened_gpu" in line for line in collected)
