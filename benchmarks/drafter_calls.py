"""One request's drafter calls, as the epoch's tail makes them: what a call costs beyond the core's work.

    python -m benchmarks.drafter_calls [--steps 20000]

At the end of an epoch one sequence is left, and each engine step makes one `propose` and
one `commit_step` for it: the calls' fixed cost (Python, ctypes) is most of such a step.
This replays requests through the compiled drafter (the engine-log replay's GRPO workload,
`benchmarks.drafter_steps`: the last epoch's samples one after another, their earlier
epochs loaded as history), step after step: each step proposes, then commits what the
sample's response accepts of the draft and the next token, in two ways of making the same
commit, each on its own drafter (the same rows reach the core, the same drafts follow),
interleaved step by step:
  commit_step  `commit_step([request], ...)`: one request's row packed on its own
               (`CompiledDrafter._commit_one`);
  staged       `record_acceptance` + `add_tokens` + `flush`: the row staged in the five
               column arrays and the commit block packed, as several requests' commits are.
Thread CPU time per call (each way's commit, and its drafter's propose), p50 and p99 over
the steps, and the commits' ratio.
Writes benchmarks/results/drafter_calls.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import drafter_steps as S
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table

RESULTS = Path(__file__).resolve().parent / "results"


def measure(steps: int) -> dict[str, list[int]]:
    """Thread ns per call: each way's commit, and the propose before it. Two drafters,
    one per way, get the same requests and the same steps, interleaved step by step (one
    drafter taking both ways would make each way undo what the other's next call keeps:
    the commit block pointed at the row, or at the columns)."""
    records, history = S._history()
    last = max(r.epoch for r in records)
    samples = [r for r in records if r.epoch == last and len(r.token_ids) > 1]  # the epoch the history predicts
    ways = ("commit_step", "staged")
    drafters = {way: S._drafter(history, "compiled") for way in ways}
    times: dict[str, list[int]] = {f"{name} {way}": [] for way in ways for name in ("propose", "commit")}
    clock = time.thread_time_ns
    n = at = 0
    truth: list[int] = []
    for _ in range(steps):
        if at + 1 >= len(truth):  # the next sample once this one's response is used up
            r = samples[n % len(samples)]
            for drafter in drafters.values():
                if truth:
                    drafter.stop_request(f"r{n - 1}")
                drafter.start_request(f"r{n}", r.prompt_id, r.prompt_token_ids.tolist())
            truth, at = r.token_ids.tolist(), 0
            n += 1
        rid = f"r{n - 1}"
        committed = None
        for way, drafter in drafters.items():
            t = clock()
            (draft,) = drafter.propose([rid], [16], [frozenset()])
            times[f"propose {way}"].append(clock() - t)
            accepted = 0
            while accepted < len(draft) and at + accepted < len(truth) and draft[accepted] == truth[at + accepted]:
                accepted += 1
            tokens = truth[at:at + accepted + 1]
            t = clock()
            if way == "commit_step":
                drafter.commit_step([rid], [len(draft)], [accepted], tokens, [len(tokens)])
            else:
                if draft:
                    drafter.record_acceptance(rid, len(draft), accepted)
                drafter.add_tokens(rid, tokens)
                drafter.flush()
            times[f"commit {way}"].append(clock() - t)
            assert committed in (None, tokens), "the two drafters drafted differently"
            committed = tokens
        at += len(committed)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20000)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    times = measure(args.steps)
    rows = [dict(call=name, calls=len(ns), p50=float(np.percentile(ns, 50)) / 1e3,
                 p99=float(np.percentile(ns, 99)) / 1e3) for name, ns in times.items()]
    by = {r["call"]: r for r in rows}
    ratio = {q: by["commit commit_step"][q] / by["commit staged"][q] for q in ("p50", "p99")}
    commit = git_commit()
    meta = dict(device=f"cpu ({cpu_name()})", python=platform.python_version(), git_commit=commit,
                command="python -m benchmarks.drafter_calls " + " ".join(sys.argv[1:]),
                load_average_1min=[load_before, os.getloadavg()[0]], timing_clock="thread CPU time")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter_calls.json").write_text(json.dumps(dict(rows=rows, commit_step_vs_staged=ratio, **meta),
                                                            indent=1) + "\n")
    table = markdown_table(rows, [("call", "call", "{}"), ("calls", "calls", "{}"), ("p50 µs", "p50", "{:.2f}"),
                                  ("p99 µs", "p99", "{:.2f}")])
    text = (f"# One request's drafter calls\n\ndevice: {meta['device']}; commit {commit}; load "
            f"{meta['load_average_1min'][0]:.2f}-{meta['load_average_1min'][1]:.2f}\n\n"
            f"command: `{meta['command']}`\n\n{table}\n\ncommit_step / staged: p50 {ratio['p50']:.2f}, "
            f"p99 {ratio['p99']:.2f}\n")
    (args.out / "drafter_calls.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
