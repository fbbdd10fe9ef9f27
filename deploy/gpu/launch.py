"""Runs the project's GPU work on a machine with the GPU machine's Python and the bundle.

    python3 deploy/gpu/launch.py check           # the bundle installs, everything imports
    python3 deploy/gpu/launch.py test            # make test-gpu: the GPU test tier
    python3 deploy/gpu/launch.py bench           # make bench-gpu: every GPU figure of engine.json
    python3 deploy/gpu/launch.py e2e -- --workers 4 --epochs 4   # the end-to-end benchmark
    python3 deploy/gpu/launch.py train           # the `small` policy preset on the GPU
    python3 deploy/gpu/launch.py campaign --budget-s 480 --copy-to $OUT   # one GPU window, in one call

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
import os
import re
import shutil
import tarfile
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
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
    "campaign": None,
}


@dataclass
class Part:
    """One measurement of the campaign: its command (run from the repository root, with
    `--out` added), the share of the budget by which it must have ended, and the signal
    that makes it stop and keep what it has (the benchmarks write as they go and unwind on
    SIGTERM; pytest writes its report on SIGINT)."""

    name: str
    args: list[str]
    ends_at: float  # share of the budget
    stop: int = signal.SIGTERM
    out_flag: bool = True
    min_s: float = 10.0  # not started with less time than this left


TINY_SHAPE = "tiny=64,96,3,4,2,32,64"  # a dry run's target for the 32-wide micro policy of the rehearsal
# Priority order: each part may run until its share of the budget has passed (an early
# finish leaves the time to the next); the last 3% are for writing and copying.
# gpu_check first: whether the engine computes the policy at a real shape on this GPU
# (in the H200 window of 2026-11-26 the sweep's plain runs did not stop where the CPU's do),
# without which the speed figures after it mean little.
GPU_CHECK = ["tests/gpu/test_engine_gpu.py::test_a_second_engine_over_the_same_model_leaves_the_first_ones_graphs_right",
             "tests/gpu/test_engine_gpu.py::test_speculation_equals_plain_decoding",
             "tests/gpu/test_engine_gpu.py::test_output_matches_the_cpu_reference",
             "tests/gpu/test_widened_gpu.py"]  # quickest first: a cut part keeps what ran
TEST_PARTS = ("gpu_check", "gpu_tests")  # pytest runs: a JUnit report, summarized as <name>.json/.md
CAMPAIGN = [
    Part("gpu_check", ["-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", *GPU_CHECK], 0.14,
         stop=signal.SIGINT, out_flag=False),
    Part("engine_steps", ["-m", "benchmarks.engine_steps", "--device", "cuda"], 0.36),
    Part("cost_probe", ["-m", "benchmarks.cost_probe"], 0.42),
    Part("spec_sweep", ["-m", "benchmarks.spec_sweep", "--device", "cuda", "--model-dir", "models/tiny"], 0.70),
    Part("e2e", ["-m", "benchmarks.e2e_bench", "--device", "cuda", "--workers", "1", "--widen", "Qwen2.5-1.5B",
                 "--model-dir", "models/tiny", "--epochs", "6", "--prompts", "16", "--n", "8", "--max-tokens", "384",
                 "--max-num-seqs", "128", "--kv-blocks", "4096"], 0.91),
    Part("gpu_tests", ["-m", "pytest", "-q", "-ra", "-m", "gpu", "-p", "no:cacheprovider", "tests"], 0.97,
         stop=signal.SIGINT, out_flag=False),
]
# Beside the cost probe (which replays CUDA graphs: its host waits on the GPU), a CPU-only
# measurement that costs the window no slice of its own: the compiled drafter's host time
# per engine step on this machine's CPU, where it runs in production (about 20 s; the same
# command in a dry run). It may run on past the probe until its own share.
SIDE = Part("drafter_host", ["-m", "benchmarks.drafter_host", "--rounds", "3"], 0.45)
SIDE_BESIDE = "cost_probe"
SIDE_DRY_RUN = ["-m", "benchmarks.drafter_host", "--rounds", "1"]  # (the rehearsal: the command, once)
# --dry-run (the CPU rehearsal): the same parts, tiny shapes, a checkpoint given by --model-dir.
DRY_RUN = {
    "gpu_check": ["-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", *GPU_CHECK],
    "engine_steps": ["-m", "benchmarks.engine_steps", "--dry-run"],
    "cost_probe": ["-m", "benchmarks.cost_probe", "--dry-run"],
    "spec_sweep": ["-m", "benchmarks.spec_sweep", "--device", "cpu", "--dry-run", "--shape", TINY_SHAPE,
                   "--batches", "1,4", "--max-tokens", "16"],
    "e2e": ["-m", "benchmarks.e2e_bench", "--device", "cpu", "--workers", "1", "--widen", TINY_SHAPE, "--epochs", "1",
            "--prompts", "2", "--n", "2", "--max-tokens", "8"],
    "gpu_tests": ["-m", "pytest", "-q", "-ra", "-m", "gpu", "-p", "no:cacheprovider", "tests/gpu"],
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
        command += ["--out", relative(out)]
    print(f"$ {shown(command)}", flush=True)
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
    summary = summarize_tests(out / "gpu_tests.xml", out, shown(command)) if mode == "test" else None
    if mode == "train" and (ROOT / "models/small/train_log.json").exists():
        shutil.copy2(ROOT / "models/small/train_log.json", out / "train_small.json")
    if code != 0:
        raise NotReady(f"`{mode}` failed (exit {code}); its output is above")
    if summary is not None and summary["passed"] == 0:
        raise NotReady("the GPU test tier ran no test (all skipped or none collected)")


def relative(path: Path) -> str:
    """`path` relative to the repository root when it is inside it (what results record)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def shown(command: list[str]) -> str:
    """The command as results record it: `python3` for this interpreter, paths inside the
    repository relative to its root, a JUnit report (a temporary file) left out."""
    words = []
    for word in command:
        if word == sys.executable:
            word = "python3"
        elif word.startswith("/"):
            word = relative(Path(word))
        words.append(word)
    if "--junitxml" in words:
        i = words.index("--junitxml")
        del words[i:i + 2]
    return " ".join(words)


def summarize_tests(xml: Path, out: Path, command: str, interrupted: bool = False, commit: str | None = None,
                    name: str = "gpu_tests") -> dict:
    """<name>.json / .md from pytest's JUnit XML: counts, and each test's outcome and time."""
    if not xml.exists():
        raise NotReady("pytest wrote no report (it did not start; its output is above)")
    tests = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        if case.get("name") is None:  # the test running when pytest was interrupted: no outcome
            continue
        outcome, reason = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                reason = (child.get("message") or "")[:200]
        tests.append(dict(name=f"{case.get('classname')}::{case.get('name')}", outcome=outcome,
                          seconds=float(case.get("time") or 0), reason=reason))
    counts = {k: sum(t["outcome"] == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    summary = dict(device=json.loads((out / "device.json").read_text())["device"], command=command,
                   commit=commit or _commit(), **counts, seconds=sum(t["seconds"] for t in tests), interrupted=interrupted,
                   tests=tests)
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    title = {"gpu_check": "GPU check: the engine keeps the policy at a real shape"}.get(name, "GPU test tier")
    lines = [f"# {title}\n\n- device: {summary['device']}\n- commit: {summary['commit']}\n"
             f"- command: `{command}`\n- {', '.join(f'{v} {k}' for k, v in counts.items())} "
             f"in {summary['seconds']:.0f} s" + (" (stopped at the campaign's time limit: the tests not listed did "
                                                  "not run)" if interrupted else "") + "\n",
             "| test | outcome | s | reason |", "|---|---|---|---|"]
    lines += [f"| {t['name']} | {t['outcome']} | {t['seconds']:.1f} | {t['reason']} |" for t in tests]
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    xml.unlink()
    return summary


def _commit() -> str:
    sys.path.insert(0, str(ROOT))
    from benchmarks.provenance import git_commit

    return git_commit()


def run_part(command: list[str], env: dict, timeout_s: float, stop: int) -> tuple[int, bool]:
    """Runs `command` for at most `timeout_s`; past it, `stop` asks it to end and keep what it
    has (30 s), then its whole process group is killed. (exit code, whether it was cut).
    The part gets `stop` at its default disposition: a launcher started in the background
    by a non-interactive shell has SIGINT ignored, children inherit that, and a Python
    started with SIGINT ignored never raises KeyboardInterrupt (pytest would not stop and
    write its report; it would be killed 30 s later with nothing kept)."""
    return finish_part(start_part(command, env, stop), timeout_s, stop)


def start_part(command: list[str], env: dict, stop: int, stdout=None) -> subprocess.Popen:
    """`command` started in its own process group, `stop` at its default disposition (run_part)."""
    return subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True, stdout=stdout,
                            stderr=None if stdout is None else subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(stop, signal.SIG_DFL))


def finish_part(child: subprocess.Popen, timeout_s: float, stop: int) -> tuple[int, bool]:
    """Waits for a part started by start_part at most `timeout_s`, then stops it as run_part
    says: (exit code, whether it was cut)."""
    cut = False
    try:
        code = child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        cut = True
        code = None
    finally:  # cut, or this launcher stopped (a time limit's SIGTERM): the part ends first
        if child.poll() is None:
            child.send_signal(stop)
            try:
                code = child.wait(30)
            except subprocess.TimeoutExpired:
                code = None
        try:
            os.killpg(child.pid, signal.SIGKILL)  # what it left running (servers of a killed benchmark)
        except ProcessLookupError:
            pass
    return (child.wait() if code is None else code), cut


def campaign(runtime, out: Path, budget_s: float, started: float, copy_to: Path | None, dry_run: bool = False,
             model_dir: str | None = None, parts: list[Part] = CAMPAIGN) -> dict:
    """The parts in priority order, each until its share of the budget has passed;
    campaign.json/.md and each part's results are written to `out` (and copied to
    `copy_to`) the moment the part ends. Returns the campaign's record."""
    env = runtime.env()
    run_since = time.time() - (time.monotonic() - started) - 1.0  # the archive holds every part's files
    record = dict(device=json.loads((out / "device.json").read_text())["device"], commit=env.get("RHYMERL_COMMIT")
                  or _commit(), command=f"python3 deploy/gpu/launch.py campaign --budget-s {budget_s:g}"
                  + (" --dry-run" if dry_run else ""), budget_s=budget_s, dry_run=dry_run,
                  environment_check_s=round(time.monotonic() - started, 1), parts=[])
    print(f"environment checked in {record['environment_check_s']:.0f} s", flush=True)
    side = None  # SIDE's process while it runs
    try:
        for part in parts:
            deadline = started + part.ends_at * budget_s
            args = list(DRY_RUN[part.name] if dry_run else part.args)
            if dry_run and part.name in ("spec_sweep", "e2e"):
                args += ["--model-dir", model_dir]
            if part.out_flag:
                args += ["--out", relative(out)]
            if part.name == "e2e":  # starts no epoch after this: the last one ends inside the slice
                args += ["--budget-s", f"{max(1.0, (deadline - time.monotonic()) * 0.65):.0f}"]
            if part.name in TEST_PARTS:
                args += ["--junitxml", str(out / f"{part.name}.xml")]
            command = PY + args
            entry = dict(name=part.name, command=shown(command), ends_by_s=round(deadline - started))
            left = deadline - time.monotonic()
            since = time.time()
            if left < part.min_s:
                entry.update(status="skipped", reason=f"{max(left, 0):.0f} s left of its slice")
            else:
                if part.name == SIDE_BESIDE:
                    side = start_side(out, env, started, budget_s, dry_run)
                print(f"\n=== {part.name} (until {entry['ends_by_s']} s of {budget_s:g}) $ {entry['command']}",
                      flush=True)
                start = time.monotonic()
                code, cut = run_part(command, env, left, part.stop)
                entry.update(seconds=round(time.monotonic() - start, 1), exit=code,
                             status="cut" if cut else "done" if code == 0 else "failed")
                if part.name in TEST_PARTS:
                    try:
                        summary = summarize_tests(out / f"{part.name}.xml", out, entry["command"], interrupted=cut,
                                                  commit=env.get("RHYMERL_COMMIT"), name=part.name)
                        entry["tests"] = {k: summary[k] for k in ("passed", "failed", "error", "skipped")}
                        if summary["passed"] + summary["failed"] + summary["error"] == 0:
                            entry["reason"] = ("cut before a test ended (collecting the suite takes about 20 s)" if cut
                                               else "no test ran (all skipped: no CUDA?)")
                    except NotReady as exc:
                        entry["reason"] = str(exc)
            entry["files"] = sorted(p.name for p in out.iterdir() if p.is_file() and p.stat().st_mtime >= since
                                    and not p.name.startswith(("campaign.", SIDE.name)))
            record["parts"].append(entry)
            write_campaign(out, record)
            print(f"=== {part.name}: {entry['status']} ({entry.get('seconds', 0):.0f} s): {' '.join(entry['files'])}",
                  flush=True)
            if side is not None:
                record["parts"].append(join_side(side, out))
                side = None
                write_campaign(out, record)
            if copy_to:
                copy_results(out, run_since, copy_to)
    finally:  # stopped (a time limit's SIGTERM) while SIDE ran: it ends with the launcher
        if side is not None and side["child"].poll() is None:
            os.killpg(side["child"].pid, signal.SIGKILL)
    return record


def start_side(out: Path, env: dict, started: float, budget_s: float, dry_run: bool = False) -> dict:
    """Starts SIDE in the background (its output to <out>/drafter_host.log); join_side
    waits for it until its share of the budget has passed."""
    command = PY + (SIDE_DRY_RUN if dry_run else SIDE.args) + ["--out", relative(out)]
    print(f"\n=== {SIDE.name} (beside {SIDE_BESIDE}, until {SIDE.ends_at * budget_s:.0f} s) $ {shown(command)}",
          flush=True)
    with open(out / f"{SIDE.name}.log", "w") as log:
        child = start_part(command, env, SIDE.stop, stdout=log)
    return dict(child=child, command=shown(command), since=time.time(), start=time.monotonic(),
                deadline=started + SIDE.ends_at * budget_s, ends_by_s=round(SIDE.ends_at * budget_s))


def join_side(side: dict, out: Path) -> dict:
    """SIDE's campaign entry once it has ended (cut at its deadline as every part is: finish_part)."""
    code, cut = finish_part(side["child"], max(1.0, side["deadline"] - time.monotonic()), SIDE.stop)
    entry = dict(name=SIDE.name, command=side["command"], ends_by_s=side["ends_by_s"], beside=SIDE_BESIDE,
                 seconds=round(time.monotonic() - side["start"], 1), exit=code,
                 status="cut" if cut else "done" if code == 0 else "failed",
                 files=sorted(p.name for p in out.iterdir() if p.is_file() and p.name.startswith(SIDE.name)
                              and p.stat().st_mtime >= side["since"]))
    print(f"=== {SIDE.name}: {entry['status']} ({entry['seconds']:.0f} s): {' '.join(entry['files'])}", flush=True)
    return entry


def write_campaign(out: Path, record: dict) -> None:
    (out / "campaign.json").write_text(json.dumps(record, indent=1) + "\n")
    lines = [f"# GPU campaign\n\n- device: {record['device']}\n- commit: {record['commit']}\n"
             f"- command: `{record['command']}`\n- environment check: {record['environment_check_s']} s\n",
             "| part | status | s | until s | files |", "|---|---|---|---|---|"]
    lines += [f"| {p['name']} | {p['status']}{' (' + p['reason'] + ')' if p.get('reason') else ''} | "
              f"{p.get('seconds', '–')} | {p['ends_by_s']} | {' '.join(p['files'])} |" for p in record["parts"]]
    (out / "campaign.md").write_text("\n".join(lines) + "\n")


RESULTS_ARCHIVE = "results.tgz"
PLAIN_COPIES = ("campaign.md", "campaign.json", "device.json")


def copy_results(out: Path, since: float, dest: Path) -> None:
    """Every result file written to `out` since `since` (the run's start), packed into
    dest/results.tgz (rewritten whole, atomically, after each part), and the campaign's
    summary beside it as plain files. The device tool returns at most 8 files from $OUT
    (alphabetically first), and a campaign writes about 15: one archive keeps them all."""
    dest.mkdir(parents=True, exist_ok=True)
    files = [p for p in sorted(out.iterdir()) if p.is_file() and p.stat().st_mtime >= since]
    partial = dest / (RESULTS_ARCHIVE + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=p.name)
    os.replace(partial, dest / RESULTS_ARCHIVE)
    for p in files:
        if p.name in PLAIN_COPIES:
            shutil.copy2(p, dest / p.name)
    print(f"packed {len(files)} result files into {dest / RESULTS_ARCHIVE}: {' '.join(p.name for p in files)}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--bundle", default=str(ROOT / ".gpu-bundle"))
    parser.add_argument("--site", help="where the bundle is installed (default: a folder in /tmp per bundle)")
    parser.add_argument("--copy-to", help="copy the result files this run wrote to this folder")
    parser.add_argument("--budget-s", type=float, default=480.0, help="campaign: end within this many seconds")
    parser.add_argument("--dry-run", action="store_true",
                        help="campaign: the CPU rehearsal (tiny shapes, --model-dir, results to --out)")
    parser.add_argument("--model-dir", help="campaign --dry-run: the checkpoint to widen")
    parser.add_argument("--out", help="campaign --dry-run: the results folder")
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.dry_run and not (args.mode == "campaign" and args.model_dir and args.out):
        parser.error("--dry-run is for `campaign`, with --model-dir and --out")
    start = time.time()
    started = time.monotonic()

    def stopped(signum, frame):
        raise NotReady(f"stopped by signal {signum} (a time limit?); the results written so far are kept")

    signal.signal(signal.SIGTERM, stopped)
    try:
        runtime = GPURuntime(Path(args.bundle), Path(args.site) if args.site else None)
        # Paths inside the checkout as the repository names them: the log is committed with the results.
        print(f"rhymerl GPU run `{args.mode}`: Python {sys.version.split()[0]} "
              f"+ bundle {relative(runtime.bundle)} (built at {runtime.manifest.get('commit')})", flush=True)
        runtime.install()
        server, version = runtime.check_redis()
        print(f"{relative(Path(server))}: {version}", flush=True)
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
        if args.dry_run:
            device["device"] = "CPU (campaign dry run)"
            out = Path(args.out).resolve()
        elif not device["cuda_available"]:
            raise NotReady(f"no CUDA device: torch {device['torch']} sees none (torch.cuda.is_available() is False)")
        else:
            out = device_folder(device["device"])
        out.mkdir(parents=True, exist_ok=True)
        (out / "device.json").write_text(json.dumps(device, indent=1) + "\n")
        if args.copy_to:
            copy_results(out, start, Path(args.copy_to))
        if args.mode == "campaign":
            record = campaign(runtime, out, args.budget_s, started, Path(args.copy_to) if args.copy_to else None,
                              args.dry_run, args.model_dir)
            if not any(p["status"] == "done" for p in record["parts"] if p["name"] not in TEST_PARTS):
                raise NotReady("the campaign measured nothing (campaign.md says why each part ended)")
            return 0
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
