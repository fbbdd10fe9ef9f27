"""Runs the project's GPU work on a machine with the GPU machine's Python and the bundle.

    python3 deploy/gpu/launch.py check           # the bundle installs, everything imports
    python3 deploy/gpu/launch.py test            # make test-gpu: the GPU test tier
    python3 deploy/gpu/launch.py bench           # make bench-gpu: every GPU figure of engine.json
    python3 deploy/gpu/launch.py e2e -- --workers 4 --epochs 4   # the end-to-end benchmark
    python3 deploy/gpu/launch.py train           # the `small` policy preset on the GPU

No apt, no pip index, no network: the bundle (`make gpu-bundle`, carried with the working
tree) brings what the machine's `python3` lacks. Each mode prints what it does, writes its
results to benchmarks/results/<device>/ (e.g. nvidia-h100-80gb-hbm3/), and --copy-to
copies the files it wrote to a folder (the device run's $OUT). It exits non-zero with
one line saying what is missing (CUDA, a package, the bundle) and when it measured nothing.
Arguments after `--` go to the mode's command. docs/gpu.md has the campaign plan.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_runtime import ROOT, GPURuntime, NotReady

RESULTS = ROOT / "benchmarks" / "results"
PY = [sys.executable]
MODES = {
    "check": None,
    "test": PY + ["-m", "pytest", "-q", "-ra", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
    "bench": PY + ["-m", "benchmarks.run_all", "--device", "cuda"],
    "e2e": PY + ["-m", "benchmarks.e2e_bench", "--device", "cuda"],
    "train": PY + ["-m", "benchmarks.tiny_llm.train_sft", "--preset", "small", "--device", "cuda",
                   "--out", "models/small", "--seed", "0"],
}


def device_folder(name: str) -> Path:
    return RESULTS / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def run(mode: str, runtime: GPURuntime, out: Path, extra: list[str]) -> None:
    """The mode's command in the runtime's environment; raises NotReady when it failed or
    measured nothing."""
    command = MODES[mode] + extra
    if mode == "test":
        command += ["--junitxml", str(out / "gpu_tests.xml")]
    elif mode in ("bench", "e2e"):
        command += ["--out", str(out)]
    print(f"$ {' '.join(command)}", flush=True)
    start = time.monotonic()
    child = subprocess.Popen(command, cwd=ROOT, env=runtime.env())
    try:
        code = child.wait()
    finally:  # stopped (a time limit's SIGTERM): the child stops its own processes and writes what it has
        if child.poll() is None:
            child.terminate()
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
    print(f"({mode}: exit {code} after {time.monotonic() - start:.0f} s)", flush=True)
    summary = summarize_tests(out / "gpu_tests.xml", out, " ".join(command)) if mode == "test" else None
    if mode == "train" and (ROOT / "models/small/train_log.json").exists():
        shutil.copy2(ROOT / "models/small/train_log.json", out / "train_small.json")
    if code != 0:
        raise NotReady(f"`{mode}` failed (exit {code}); its output is above")
    if summary is not None and summary["passed"] == 0:
        raise NotReady("the GPU test tier ran no test (all skipped or none collected)")


def summarize_tests(xml: Path, out: Path, command: str) -> dict:
    """gpu_tests.json / .md from pytest's JUnit XML: counts, and each test's outcome and time."""
    if not xml.exists():
        raise NotReady("pytest wrote no report (it did not start; its output is above)")
    tests = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                reason = (child.get("message") or "")[:200]
        tests.append(dict(name=f"{case.get('classname')}::{case.get('name')}", outcome=outcome,
                          seconds=float(case.get("time") or 0), reason=reason))
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    summary = dict(device=json.loads((out / "device.json").read_text())["device"], command=command,
                   commit=_commit(), **counts, seconds=sum(t["seconds"] for t in tests), tests=tests)
    (out / "gpu_tests.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [f"# GPU test tier\n\n- device: {summary['device']}\n- commit: {summary['commit']}\n"
             f"- command: `{command}`\n- {', '.join(f'{v} {k}' for k, v in counts.items())} "
             f"in {summary['seconds']:.0f} s\n", "| test | outcome | s | reason |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['outcome']} | {t['seconds']:.1f} | {t['reason']} |" for t in tests]
    (out / "gpu_tests.md").write_text("\n".join(lines) + "\n")
    xml.unlink()
    return summary


def _commit() -> str:
    sys.path.insert(0, str(ROOT))
    from benchmarks.provenance import git_commit

    return git_commit()


def copy_results(out: Path, since: float, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    files = [p for p in sorted(out.iterdir()) if p.is_file() and p.stat().st_mtime >= since]
    for p in files:
        shutil.copy2(p, dest / p.name)
    print(f"copied {len(files)} result files to {dest}: {' '.join(p.name for p in files)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--bundle", default=str(ROOT / ".gpu-bundle"))
    parser.add_argument("--site", help="where the bundle is installed (default: a folder in /tmp per bundle)")
    parser.add_argument("--copy-to", help="copy the result files this run wrote to this folder")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    start = time.time()

    def stopped(signum, frame):
        raise NotReady(f"stopped by signal {signum} (a time limit?); the results written so far are kept")

    signal.signal(signal.SIGTERM, stopped)
    try:
        runtime = GPURuntime(Path(args.bundle), Path(args.site) if args.site else None)
        print(f"rhymerl GPU run `{args.mode}`: Python {sys.version.split()[0]} ({sys.executable}) "
              f"+ bundle {runtime.bundle} (built at {runtime.manifest.get('commit')})", flush=True)
        runtime.install()
        print(runtime.check_redis(), flush=True)
        print("importing every module of services/, kernels/, benchmarks/ and the SDK ...", flush=True)
        runtime.check_imports()
        device = runtime.device()
        print("torch {torch} (CUDA build {cuda_build}), Triton {triton}, device: {device}".format(**device), flush=True)
        if args.mode == "check":
            collect = MODES["test"] + ["--collect-only"]
            print(f"$ {' '.join(collect)}", flush=True)
            if subprocess.run(collect, cwd=ROOT, env=runtime.env(), stdout=subprocess.DEVNULL).returncode != 0:
                raise NotReady("the GPU test tier does not collect here (pytest's errors are above)")
            print("environment complete" + ("" if device["cuda_available"] else " (no CUDA device here)"))
            return 0
        if not device["cuda_available"]:
            raise NotReady(f"no CUDA device: torch {device['torch']} sees none (torch.cuda.is_available() is False)")
        out = device_folder(device["device"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "device.json").write_text(json.dumps(device, indent=1) + "\n")
        try:
            run(args.mode, runtime, out, extra)
        finally:
            if args.copy_to:
                copy_results(out, start, Path(args.copy_to))
    except (NotReady, subprocess.TimeoutExpired) as exc:
        print(f"gpu {args.mode}: NOT DONE: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
