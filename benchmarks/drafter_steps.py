"""The drafter's host cost per engine step, on the GRPO workload of engine_grpo.py.

Recording (once, minutes on CPU): the engine runs `engine_grpo`'s T=1 GRPO batch with
the recorded earlier epochs as history (as its speculative row does) through a drafter
that logs every call the engine makes, and each draft it got. Replaying: a fresh drafter
of each backend (the compiled core, the Python HistoDrafter, vLLM's suffix tree behind its
Python wrapper) gets the same calls, timed per engine step in thread CPU time (`propose`,
and the commits after the verify: as the engine sends them now, each run of
`record_acceptance`/`add_tokens` calls in one `commit_step` for a drafter that has it (a log
recorded per call is batched so, in the same order: `batched`), else those calls and the
compiled drafter's flush of them), and every draft of ours is compared with the recorded one,
so the log doubles as a check that a change to the drafter left its drafts as they were.
Writes benchmarks/results/drafter_steps.json (the issue's `drafter_step_us` per backend).

    python -m benchmarks.drafter_steps [--log benchmarks/data/drafter_steps_grpo.pkl] [--record] [--rounds 3]

The log is recorded with the drafter of the checkout that records it: record before a
change, replay after it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import platform
import sys
import time
from functools import partial
from pathlib import Path

from benchmarks import engine_grpo as g
from benchmarks import drafter_replay as R
from benchmarks.drafter_replay import PAUSES, step_summary
from benchmarks.engine_run import run_engine
from benchmarks.peers.suffix_decoding import (
    MAX_CACHED_REQUESTS,
    MAX_TREE_DEPTH,
    PeerSuffixDrafter,
    PeerUnavailable,
    load_peer,
)
from benchmarks.provenance import cpu_name, git_commit
from services.common.traces import read_traces
from services.rollout.drafter import HistoDrafter
from services.rollout.drafter.compiled import CompiledDrafter
from services.rollout.engine import LLMEngine
from services.rollout.engine.drafter_protocol import commit_step

_CALLS = ("start_request", "add_tokens", "propose", "record_acceptance", "commit_step", "stop_request")
_COMMITS = ("add_tokens", "record_acceptance", "commit_step")


def batched(log: list[tuple]) -> list[tuple]:
    """The log with each run of consecutive record_acceptance/add_tokens calls as one
    commit_step, as the engine sends a step's commits now: one row per call, a request's
    record_acceptance and the add_tokens right after it in one row (the same calls in the
    same order: drafter_protocol.commit_calls)."""
    out: list[tuple] = []
    run: list = []  # [ids, drafts, accepted, tokens, counts]
    for entry in log:
        name, args = entry[0], entry[1]
        if name not in ("add_tokens", "record_acceptance"):
            if run:
                out.append(("commit_step", run, {}, None))
                run = []
            out.append(entry)
            continue
        if not run:
            run = [[], [], [], [], []]
        ids, drafts, accepted, tokens, counts = run
        if name == "record_acceptance":
            ids.append(args[0])
            drafts.append(args[1])
            accepted.append(args[2])
            counts.append(-1)
        elif ids and ids[-1] == args[0] and counts[-1] == -1:
            counts[-1] = len(args[1])
            tokens += args[1]
        else:
            ids.append(args[0])
            drafts.append(0)
            accepted.append(0)
            counts.append(len(args[1]))
            tokens += args[1]
    if run:
        out.append(("commit_step", run, {}, None))
    return out


def _history() -> tuple[list, dict[str, list[list[int]]]]:
    records = read_traces(g.TRACES)
    last = max(r.epoch for r in records)
    history: dict[str, list[list[int]]] = {}
    for r in records:
        if r.epoch < last:
            history.setdefault(r.prompt_id, []).append([int(t) for t in r.token_ids])
    return records, history


def _drafter(history: dict[str, list[list[int]]], backend: str = "python", peer=None):
    """A fresh drafter of `backend` (python: HistoDrafter; compiled: the C++ core; peer:
    vLLM's suffix tree behind its Python wrapper) with the recorded history loaded."""
    if backend == "peer":
        return PeerSuffixDrafter(lambda: peer(MAX_TREE_DEPTH, MAX_CACHED_REQUESTS))
    d = HistoDrafter() if backend == "python" else CompiledDrafter()
    for prompt_id, responses in history.items():
        d.load_history(prompt_id, responses)
    return d


class _Recorder:
    """Passes the engine's calls to a drafter and logs them (with propose's answers)."""

    def __init__(self, drafter: HistoDrafter) -> None:
        self.drafter = drafter
        self.log: list[tuple] = []

    def __getattr__(self, name):
        method = getattr(self.drafter, name)
        if name not in _CALLS:
            return method

        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            frozen = [list(a) if isinstance(a, (list, tuple)) and name != "propose" else a for a in args]
            self.log.append((name, frozen, kwargs, out if name == "propose" else None))
            return out
        return call


def record(path: Path, model_dir: str, num_prompts: int, samples: int, max_tokens: int) -> None:
    model = g.trained_policy(model_dir, "cpu")
    eos = tuple(model.config.eos_token_ids)
    records, history = _history()
    recorder = _Recorder(_drafter(history))
    engine = LLMEngine(model, device="cpu", max_num_seqs=256, max_num_batched_tokens=2048, block_size=16,
                       num_kv_blocks=4096, drafter=recorder, speculative=True, max_draft_len=16)
    _, seconds = run_engine(engine, g.grpo_requests(records, num_prompts, samples, 1.0, max_tokens, eos))
    path.write_bytes(pickle.dumps(recorder.log))
    print(f"recorded {len(recorder.log)} calls in {seconds:.0f} s -> {path}")


def replay(log: list[tuple], backend: str = "python", peer=None) -> tuple[list[tuple[int, int, int]], dict, int, dict]:
    """(sequences, propose ns, commit ns) per engine step (thread CPU time net of the
    garbage collector's pauses inside the spans: drafter_replay.CollectorPauses; commit =
    commit_step, or record_acceptance + add_tokens and the compiled drafter's flush of
    them), ns per method, the number of drafts that differ from the recorded ones, and the
    collections inside the spans: {"gross": the steps with their pauses, "count", "ns"}."""
    drafter = _drafter(_history()[1], backend, peer)
    flush = getattr(drafter, "flush", None)
    if hasattr(drafter, "commit_step"):
        log = batched(log)
        # every commit is then a commit_step, applied in its own call: nothing is staged,
        # and an engine makes no flush call (timing an empty one cost a clock read a step)
        flush = None
    steps: list[tuple[int, int, int]] = []
    per_method = dict.fromkeys(_CALLS, 0)
    mismatches, batch, propose_ns, commit_ns = 0, 0, 0, 0
    gross: list[tuple[int, int, int]] = []
    gross_propose = gross_commit = gc_count = gc_ns = 0
    clock = time.thread_time_ns
    gc.collect()
    for name, args, kwargs, expected in log:
        # (a log recorded with commit_step, replayed into a drafter without it: its calls one by one)
        method = getattr(drafter, name) if name != "commit_step" else partial(commit_step, drafter)
        if name == "propose":
            if flush is not None:  # the previous step's staged commits, applied in one call
                mark = PAUSES.mark()
                t0 = clock()
                flush()
                elapsed = clock() - t0
                pause, collections = PAUSES.since(mark)
                commit_ns += elapsed - pause
                gross_commit += elapsed
                gc_count, gc_ns = gc_count + collections, gc_ns + pause
            if batch:
                steps.append((batch, propose_ns, commit_ns))
                gross.append((batch, gross_propose, gross_commit))
            batch, propose_ns, commit_ns, gross_propose, gross_commit = len(args[0]), 0, 0, 0, 0
        mark = PAUSES.mark()
        t0 = clock()
        out = method(*args, **kwargs)
        elapsed = clock() - t0
        pause, collections = PAUSES.since(mark)
        per_method[name] += elapsed - pause
        if name == "propose":
            propose_ns += elapsed - pause
            gross_propose += elapsed
            if backend != "peer":
                mismatches += sum(a != b for a, b in zip(out, expected)) + abs(len(out) - len(expected))
            if R.STEP_COLLECTOR is not None:  # the worker's collections, while the step's forward runs
                R.STEP_COLLECTOR()
        elif name in _COMMITS:
            commit_ns += elapsed - pause
            gross_commit += elapsed
        if name == "propose" or name in _COMMITS:
            gc_count, gc_ns = gc_count + collections, gc_ns + pause
    if batch:
        steps.append((batch, propose_ns, commit_ns))
        gross.append((batch, gross_propose, gross_commit))
    return steps, per_method, mismatches, {"gross": gross, "count": gc_count, "ns": gc_ns}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", default="benchmarks/data/drafter_steps_grpo.pkl",
                        help="the recorded calls (the committed log by default; --record makes it anew)")
    parser.add_argument("--record", action="store_true", help="record the log anew (else: if missing)")
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="replays; the fastest is reported")
    parser.add_argument("--out", default="benchmarks/results", help="where drafter_steps.json goes")
    args = parser.parse_args()
    path = Path(args.log)
    if args.record or not path.exists():
        record(path, args.model, args.prompts, args.samples, args.max_tokens)
    log = pickle.loads(path.read_bytes())
    try:
        peer, peer_note = load_peer(), "built from the arctic-inference sdist"
    except PeerUnavailable as exc:
        peer, peer_note = None, str(exc)
    load_before = os.getloadavg()[0]
    results = {}
    for backend in ("compiled", "python", "peer"):
        if backend == "peer" and peer is None:
            results[backend] = None
            continue
        best = None
        for _ in range(args.rounds):
            steps, per_method, mismatches, pauses = replay(log, backend, peer)
            total = sum(p + c for _, p, c in steps)
            if best is None or total < best[0]:
                best = (total, steps, per_method, mismatches, pauses)
        total, steps, per_method, mismatches, pauses = best
        num_seq_steps = sum(n for n, _, _ in steps)
        results[backend] = {
            **step_summary(steps, pauses["gross"], pauses["count"], pauses["ns"]),
            "num_steps": len(steps),
            "num_sequence_steps": num_seq_steps,
            "total_ms": total / 1e6,
            "us_per_sequence_step": total / num_seq_steps / 1e3,
            "ms_per_method": {k: v / 1e6 for k, v in per_method.items()},
            "drafts_different_from_recorded": mismatches if backend != "peer" else None,
        }
        r = results[backend]
        print(f"{backend}: {len(steps)} steps, {num_seq_steps} sequence-steps; per sequence per step (>= 16 seqs): "
              f"propose p50 {r['propose_p50']:.2f} / p99 {r['propose_p99']:.2f} us, commit p50 "
              f"{r['commit_p50']:.2f} / p99 {r['commit_p99']:.2f} us; step with >= 100 seqs "
              f"{r['step_ms_100plus'] or 0:.3f} ms; one-sequence step p99 {r['one_seq_p99'] or 0:.1f} us; "
              f"drafts different from the recorded ones: {r['drafts_different_from_recorded']}")
    command = "python -m benchmarks.drafter_steps " + " ".join(sys.argv[1:])
    summary = {
        "drafter_step_us": results,
        "log": str(path), "prompts": args.prompts, "samples": args.samples, "max_tokens": args.max_tokens,
        "rounds": args.rounds, "peer_note": peer_note,
        "timing_clock": "time.thread_time_ns (CPU time of the replay thread), net of the garbage collector's pauses "
                        "inside the spans (with them: with_gc); the fastest of --rounds replays",
        "garbage_collector": R.gc_policy(),
        "device": "cpu", "cpu": cpu_name(), "python": platform.python_version(),
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "git_commit": git_commit("services/rollout/drafter", "benchmarks/drafter_steps.py"),
        "command": command,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafter_steps.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    R.worker_gc()
    main()
