"""Two builds of the compiled drafter's core, compared step by step in one replay.

On a shared machine the same build's lockstep figures move by a fifth to a third from one
run to the next (docs/drafter.md), so two builds timed in turns, run after run, cannot
show a change of a few percent. Here both run inside one lockstep replay
(`drafter_replay.replay`): every call goes to two `CompiledDrafter`s, one per library,
which take turns going first, step after step, and each call is timed on its own. A slow
spell of the machine then hits both sides of the same step, and the figures compared are
per-step pairs: the ratio B / A of each step's time, and B's total over A's with a
bootstrap interval over the steps. The two must draft the same (a change of the core's
speed, not of its drafts): every step's drafts are compared and the differences counted.

    python -m benchmarks.drafter_ab --a LIB_A --b LIB_B [--traces SET ...] [--rounds 2]
    python -m benchmarks.drafter_ab --a-rev HEAD~1 --b-rev HEAD    # builds each rev's histo.cpp

Both drafters live in one process, so each sees the caches the other leaves: the absolute
figures are those of a busier cache than a worker's, and only the ratios are the result.
Thread CPU time; the collector off during the replay (no pause falls inside a span).
Writes drafter_ab.{md,json} under --out (default: a temporary folder; a kept run goes to
benchmarks/results/drafter_runs/).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import drafter_replay as R
from benchmarks.drafter_bench import COMMITTED
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table, write_results
from services.rollout.drafter import DrafterConfig
from services.rollout.drafter.compiled import CompiledDrafter, DrafterLibraryError, load_library
from services.rollout.drafter.native import build as native_build
from services.rollout.engine.cost_model import CostModel

CORE = "services/rollout/drafter/native"
LIFECYCLE = ("start_request", "stop_request", "load_history", "add_global_responses", "release_prompt")


class Paired:
    """The replay's drafter: every call goes to `a` and `b`; the timed ones
    (`propose`, `commit_step`) are timed per side, the side going first alternating by
    step. Returns a's drafts; counts the steps where b's differ."""

    def __init__(self, a: CompiledDrafter, b: CompiledDrafter) -> None:
        self.a, self.b = a, b
        self.step = 0
        self.propose_ns: list[tuple[int, int, int]] = []  # (sequences, a ns, b ns) per step
        self.commit_ns: list[tuple[int, int, int]] = []
        self.different = 0
        for name in LIFECYCLE:
            setattr(self, name, self._both(name))
        self.memory_tokens, self.memory_bytes = a.memory_tokens, a.memory_bytes
        self.global_tokens = a.global_tokens

    def _both(self, name: str):
        fa, fb = getattr(self.a, name), getattr(self.b, name)

        def call(*args, **kw):
            fb(*args, **kw)
            return fa(*args, **kw)
        return call

    def _timed(self, name: str, args: tuple, kw: dict) -> tuple[object, object, int, int]:
        clock = time.thread_time_ns
        first, second = (self.a, self.b) if self.step % 2 == 0 else (self.b, self.a)
        f1, f2 = getattr(first, name), getattr(second, name)
        t0 = clock()
        r1 = f1(*args, **kw)
        t1 = clock()
        r2 = f2(*args, **kw)
        t2 = clock()
        if first is self.a:
            return r1, r2, t1 - t0, t2 - t1
        return r2, r1, t2 - t1, t1 - t0

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None, num_seqs=None):
        ra, rb, na, nb = self._timed("propose", (request_ids, max_lens, stop_token_ids, budget, num_seqs), {})
        self.propose_ns.append((len(request_ids), na, nb))
        self.different += ra != rb
        return ra

    def commit_step(self, request_ids, num_draft, num_accepted, token_ids, num_tokens) -> None:
        _, _, na, nb = self._timed("commit_step", (request_ids, num_draft, num_accepted, token_ids, num_tokens), {})
        self.commit_ns.append((len(request_ids), na, nb))
        self.step += 1

    def flush(self) -> None:  # (nothing is staged: the replay commits through commit_step)
        self.a.flush()
        self.b.flush()


def _ratio_interval(a: np.ndarray, b: np.ndarray, rng: np.random.Generator, draws: int = 2000) -> list[float]:
    """A 95% bootstrap interval of sum(b) / sum(a) over the paired steps."""
    idx = rng.integers(0, len(a), size=(draws, len(a)))
    ratios = b[idx].sum(axis=1) / a[idx].sum(axis=1)
    return [float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))]


def compare(pairs: list[tuple[int, int, int]], select, rng: np.random.Generator) -> dict | None:
    """A / B figures over the steps `select(n)` keeps, in µs per sequence per step."""
    rows = [(n, a, b) for n, a, b in pairs if select(n)]
    if not rows:
        return None
    n = np.array([r[0] for r in rows], dtype=np.float64)
    a = np.array([r[1] for r in rows], dtype=np.float64) / n / 1e3
    b = np.array([r[2] for r in rows], dtype=np.float64) / n / 1e3
    return {
        "steps": len(rows),
        "a_p50": float(np.percentile(a, 50)), "b_p50": float(np.percentile(b, 50)),
        "a_p99": float(np.percentile(a, 99)), "b_p99": float(np.percentile(b, 99)),
        "median_step_ratio": float(np.median(b / a)),
        "total_ratio": float((b * n).sum() / (a * n).sum()),
        "total_ratio_95": _ratio_interval(a * n, b * n, rng),
    }


def replay_pair(path: str, lib_a: str, lib_b: str, config: DrafterConfig, rng: np.random.Generator) -> dict:
    traces = R.load_traces(path)
    paired = {}

    def make() -> Paired:
        paired["p"] = Paired(CompiledDrafter(config, library=lib_a), CompiledDrafter(config, library=lib_b))
        return paired["p"]

    R.replay(traces, make, R.stop_token(traces), "ab")
    p = paired["p"]
    steps = [(n, pa + ca, pb + cb) for (n, pa, pb), (_, ca, cb) in zip(p.propose_ns, p.commit_ns)]
    return {
        "trace_set": Path(path).stem,
        "num_steps": len(p.propose_ns),
        "steps_with_different_drafts": p.different,
        "propose_16plus": compare(p.propose_ns, lambda n: n >= 16, rng),
        "commit_16plus": compare(p.commit_ns, lambda n: n >= 16, rng),
        "step_100plus": compare(steps, lambda n: n >= 100, rng),
        "one_seq_step": compare(steps, lambda n: n == 1, rng),
    }


def rev_sources(rev: str, folder: Path) -> Path:
    """`rev`'s histo.cpp and histo.h (git show) written into `folder`; returns the .cpp."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("histo.cpp", "histo.h"):
        text = subprocess.run(["git", "show", f"{rev}:{CORE}/{name}"], check=True, capture_output=True).stdout
        (folder / name).write_bytes(text)
    return folder / "histo.cpp"


def release_command(source: Path, out: Path) -> list[str]:
    """`make install`'s build of the core (native/build.py's release flags), of `source`."""
    spec = native_build.TARGETS["histo"]
    return [native_build.compiler(), *native_build.COMMON, spec.optimize, *native_build.RELEASE, "-o", str(out),
            str(source)]


def build_rev(rev: str, out: Path) -> Path:
    """The core's release build from `rev`'s sources, into `out`."""
    subprocess.run(release_command(rev_sources(rev, out.parent / f"{out.stem}_src"), out), check=True)
    return out


FIGURES = (("propose_16plus", "propose, >= 16 seqs (µs/seq)"), ("commit_16plus", "commit, >= 16 seqs (µs/seq)"),
           ("step_100plus", "step, >= 100 seqs (µs/seq)"), ("one_seq_step", "one-sequence step (µs)"))


def table(results: list[dict]) -> str:
    rows = []
    for r in results:
        for key, title in FIGURES:
            c = r[key]
            if c is None:
                continue
            lo, hi = c["total_ratio_95"]
            rows.append({"set": f"{r['trace_set']} (round {r['round']})", "figure": title, "steps": c["steps"],
                         "a": f"{c['a_p50']:.2f} / {c['a_p99']:.2f}", "b": f"{c['b_p50']:.2f} / {c['b_p99']:.2f}",
                         "median": c["median_step_ratio"], "total": f"{c['total_ratio']:.3f} [{lo:.3f}, {hi:.3f}]"})
    return markdown_table(rows, [("trace set", "set", "{}"), ("figure", "figure", "{}"), ("steps", "steps", "{}"),
                                 ("A p50 / p99", "a", "{}"), ("B p50 / p99", "b", "{}"),
                                 ("median step B/A", "median", "{:.3f}"), ("total B/A [95%]", "total", "{}")])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--a", help="library A (a built libhisto.so)")
    parser.add_argument("--b", help="library B")
    parser.add_argument("--a-rev", help="build A from this git revision's histo.cpp")
    parser.add_argument("--b-rev", help="build B from this git revision's histo.cpp")
    parser.add_argument("--traces", nargs="*", default=COMMITTED)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", default=None, help="results folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if (args.a is None) == (args.a_rev is None) or (args.b is None) == (args.b_rev is None):
        parser.error("give each side one of --a / --a-rev and --b / --b-rev")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    R.check_trace_files(parser, args.traces)
    work = Path(tempfile.mkdtemp(prefix="drafter_ab_"))
    libs = {}
    for side in ("a", "b"):  # what cannot be built or loaded is a usage error naming its option
        path, rev = getattr(args, side), getattr(args, f"{side}_rev")
        try:
            libs[side] = path or str(build_rev(rev, work / f"lib{side}.so"))
            load_library(libs[side])
        except subprocess.CalledProcessError as exc:
            parser.error(f"--{side}-rev {rev}: {' '.join(exc.cmd[:2])} failed: "
                         f"{(exc.stderr or b'').decode(errors='replace').strip() or f'exit status {exc.returncode}'}")
        except DrafterLibraryError as exc:
            parser.error(f"--{side} {path}: {str(exc).split(': run `make install`')[0]}")
    lib_a, lib_b = libs["a"], libs["b"]
    config = DrafterConfig(cost_model=CostModel())  # the product configuration (drafter_bench's rhymerl row)
    rng = np.random.default_rng(0)
    load_before = os.getloadavg()[0]
    gc.collect()
    gc.freeze()
    gc.disable()
    results = []
    try:
        for k in range(args.rounds):
            for path in args.traces:
                results.append({"round": k + 1, **replay_pair(path, lib_a, lib_b, config, rng)})
    finally:
        gc.unfreeze()
        gc.enable()
    text = table(results)
    print(text)
    summary = {
        "a": args.a_rev or lib_a, "b": args.b_rev or lib_b, "results": results,
        "timing_clock": "time.thread_time_ns per call and side, the side going first alternating by step; "
                        "collector off",
        "device": "cpu", "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "git_commit": git_commit("services/rollout/drafter", "benchmarks"),
        "command": "python -m benchmarks.drafter_ab " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = args.out or str(work)
    write_results(out, "drafter_ab", summary,
                  f"# Two builds of the drafter's core, step by step\n\nCommand: `{summary['command']}`, commit "
                  f"{summary['git_commit']}, A = {summary['a']}, B = {summary['b']}, CPU: {summary['cpu']}, "
                  f"1-min load {load_before:.1f} -> {summary['load_average_1min'][1]:.1f}. Per figure: each "
                  f"side's p50 / p99, the median over steps of B's time over A's, and B's total over A's with "
                  f"a 95% bootstrap interval over the steps. Both in one process, turns alternating by "
                  f"step: only the ratios are the result.\n\n{text}\n")
    print(f"results: {out}/drafter_ab.md")
    return summary


if __name__ == "__main__":
    main()
