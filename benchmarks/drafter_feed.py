"""The drafter's global feed against the engine's critical path: between steps, or deferred.

    python -m benchmarks.drafter_feed [--batch 64] [--repeats 3]

A worker hands its drafter's global index every finished sample and, at each new step,
the history service's stream of recent responses (services/rollout/global_feed.py; up to
131,072 tokens, `RHYMERL_WORKER_GLOBAL_RECENT_TOKENS`). The engine thread inserts them.
Here a speculating engine (the 1-layer random model of `benchmarks.engine_host`, the
compiled drafter, `--batch` greedy requests) is handed such a stream a few steps into its
run (the committed GRPO traces' responses, `--traces`, token ids folded into the model's
vocabulary), in two ways, alternating run by run:
  between   one call between two steps, as the worker's feed made it before (the
            insert sits between one step's read of its sampled tokens and the next
            forward's launch: on a GPU, the device waits for all of it);
  deferred  `LLMEngine.defer`, in chunks of `--chunk-tokens`, at most
            `--cost-per-step` tokens behind each forward's launch (what the worker's
            feed does now; engine/deferred.py).
Per step, in this thread's CPU time: "exposed", from the last step's read of its sampled
tokens to this step's forward launch (what a GPU would wait for; on this CPU the forward
itself runs inside the launch), and "deferred", the step's deferred work behind the
launch (where the paced inserts run; on a GPU it overlaps the forward). Each mode's
figures are the median over its runs. The same responses reach the index either way, in
the same order; the running requests' own tokens, which the index takes as they commit,
land between other chunks of the stream, so the two indexes' sizes after eviction differ
slightly (``global_tokens`` per run).
Writes benchmarks/results/drafter_feed.{md,json}.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from benchmarks.drafter_replay import load_traces
from benchmarks.engine_host import requests, tiny_model, worker_gc
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table
from services.rollout.drafter import DrafterConfig
from services.rollout.drafter.compiled import CompiledDrafter
from services.rollout.engine import CostModel, LLMEngine
from services.rollout.engine.input_batch import PendingRead
from services.rollout.global_feed import chunks

RESULTS = Path(__file__).resolve().parent / "results"
FEED_STEP = 8  # the stream arrives before this step (the prefill and a few verify steps done)
MODES = ("between", "deferred")


def stream(paths: list[str], vocab: int, max_tokens: int) -> list[list[int]]:
    """The traces' responses, oldest first, folded into [1, vocab), up to ``max_tokens``."""
    out, total = [], 0
    for path in paths:
        for t in load_traces(path):
            tokens = [1 + int(x) % (vocab - 1) for x in t.token_ids]
            if total + len(tokens) > max_tokens:
                return out
            out.append(tokens)
            total += len(tokens)
    return out


def run(model, mode: str, responses: list[list[int]], batch: int, new_tokens: int, chunk_tokens: int,
        cost_per_step: int) -> dict:
    drafter = CompiledDrafter(DrafterConfig(max_draft_len=4), max_slots=max(batch, 16))
    engine = LLMEngine(model, device="cpu", num_kv_blocks=4096, block_size=16, max_num_seqs=256,
                       max_num_batched_tokens=8192, drafter=drafter, speculative=True, max_draft_len=4,
                       cost_model=CostModel([(1, 1.0), (1 << 20, 1.0)]), measure_cost=False,
                       deferred_cost_per_step=cost_per_step)
    clock = time.thread_time_ns
    marks = {"read": None, "launch": None, "deferred": 0}
    run_forward, read_result, deferred_work = engine.runner.run, PendingRead.result, engine._deferred_work

    def timed_run(*args, **kw):
        marks["launch"] = clock()
        return run_forward(*args, **kw)

    def timed_read(*args, **kw):
        out = read_result(*args, **kw)
        marks["read"] = clock()
        return out

    def timed_deferred(*args, **kw):
        t = clock()
        try:
            return deferred_work(*args, **kw)
        finally:
            marks["deferred"] += clock() - t

    engine.runner.run, engine._deferred_work = timed_run, timed_deferred
    PendingRead.result = timed_read  # (the class's again when the run ends)
    try:
        for r in requests(batch, new_tokens):
            engine.add_request(r)
        gc.collect()
        exposed, deferred, landed_at, feed_exposed = [], [], None, None
        step = 0
        while engine.has_unfinished():
            last_read = marks["read"]
            if step == FEED_STEP:
                if mode == "between":  # what EngineLoop.call did: the whole stream, between two steps
                    drafter.add_global_responses(responses)
                else:
                    for chunk, num_tokens in chunks(responses, chunk_tokens):
                        engine.defer(partial(drafter.add_global_responses, chunk), num_tokens)
            marks["deferred"] = 0
            marks["launch"] = None
            engine.step()
            if last_read is not None and marks["launch"] is not None and marks["launch"] > last_read:
                gap = (marks["launch"] - last_read) / 1e6
                exposed.append(gap)
                if step == FEED_STEP:
                    feed_exposed = gap
            deferred.append(marks["deferred"] / 1e6)
            if step >= FEED_STEP and landed_at is None and engine.num_deferred() == 0:
                landed_at = step - FEED_STEP + 1
            step += 1
    finally:
        PendingRead.result = read_result
    return dict(mode=mode, steps=step, exposed_p50=float(np.median(exposed)), exposed_max=float(max(exposed)),
                feed_exposed=feed_exposed, deferred_max=float(max(deferred)), steps_to_land=landed_at,
                global_tokens=drafter.global_tokens())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", nargs="+", default=["benchmarks/data/tiny_grpo_service.npz"])
    ap.add_argument("--stream-tokens", type=int, default=131072, help="the stream's size (the worker's default)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--chunk-tokens", type=int, default=1024, help="the worker's: feed_tokens_per_step // 2")
    ap.add_argument("--cost-per-step", type=int, default=2048, help="RHYMERL_WORKER_FEED_TOKENS_PER_STEP")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    worker_gc()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = tiny_model()
    responses = stream(args.traces, model.config.vocab_size, args.stream_tokens)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            row = run(model, mode, responses, args.batch, args.new_tokens, args.chunk_tokens, args.cost_per_step)
            runs[mode].append(row)
            print(f"{mode:9s} exposed p50 {row['exposed_p50']:.3f} max {row['exposed_max']:.3f} ms, feed step "
                  f"{row['feed_exposed']:.3f} ms, deferred max {row['deferred_max']:.3f} ms, landed in "
                  f"{row['steps_to_land']} steps", flush=True)
    # every run's stream landed before its engine went idle (or in the idle step's drain)
    assert all(r["steps_to_land"] is not None for rows in runs.values() for r in rows)
    keys = ("exposed_p50", "exposed_max", "feed_exposed", "deferred_max", "steps_to_land")
    rows = [dict(mode=m, steps=runs[m][0]["steps"], **{k: statistics.median(r[k] for r in runs[m]) for k in keys})
            for m in MODES]
    by = {r["mode"]: r for r in rows}
    ratio = by["between"]["exposed_max"] / by["deferred"]["exposed_max"]
    commit = git_commit()
    meta = dict(device=f"cpu ({cpu_name()}, 1 torch thread)", python=platform.python_version(), git_commit=commit,
                command="python -m benchmarks.drafter_feed " + " ".join(sys.argv[1:]),
                load_average_1min=[load_before, os.getloadavg()[0]], timing_clock="thread CPU time",
                stream_responses=len(responses), stream_tokens=sum(map(len, responses)), batch=args.batch,
                chunk_tokens=args.chunk_tokens, cost_per_step=args.cost_per_step, repeats=args.repeats)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "drafter_feed.json").write_text(json.dumps(dict(rows=rows, runs=runs,
                                                                exposed_max_between_vs_deferred=ratio, **meta),
                                                           indent=1) + "\n")
    table = markdown_table(rows, [("mode", "mode", "{}"), ("steps", "steps", "{}"),
                                  ("exposed p50 ms", "exposed_p50", "{:.3f}"),
                                  ("exposed max ms", "exposed_max", "{:.3f}"),
                                  ("exposed at the feed ms", "feed_exposed", "{:.3f}"),
                                  ("deferred max ms", "deferred_max", "{:.3f}"),
                                  ("steps to land", "steps_to_land", "{}")])
    text = (f"# The drafter's global feed: between steps or deferred\n\ndevice: {meta['device']}; commit {commit}; "
            f"load {load_before:.2f}-{meta['load_average_1min'][1]:.2f}\n\ncommand: `{meta['command']}`\n\n"
            f"A stream of {meta['stream_responses']} responses ({meta['stream_tokens']} tokens) handed to a "
            f"speculating engine at batch {args.batch} before step {FEED_STEP}; medians of {args.repeats} runs "
            f"per mode. exposed: host time from a step's read of its sampled tokens to the next forward's launch "
            f"(what a GPU waits for); deferred: host time behind a forward's launch (overlapped on a GPU). See "
            f"the docstring of benchmarks/drafter_feed.py.\n\n{table}\n\n"
            f"Longest exposed gap, between / deferred: {ratio:.1f}x\n")
    (args.out / "drafter_feed.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
