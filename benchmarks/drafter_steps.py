"""The drafter's host cost per engine step, on the GRPO workload of engine_grpo.py.

Recording (once, minutes on CPU): the engine runs `engine_grpo`'s T=1 GRPO batch with
the recorded earlier epochs as history (as its speculative row does) through a drafter
that logs every call the engine makes, and each draft it got. Replaying: a fresh
HistoDrafter gets the same calls, timed per engine step (one `propose` and the
`record_acceptance`/`add_tokens`/`stop_request`/`start_request` calls after it), and
every draft is compared with the recorded one, so the log doubles as a check that a
change to the drafter left its drafts as they were.

    python -m benchmarks.drafter_steps [--log /tmp/drafter_steps.pkl] [--record] [--rounds 3]

The log is recorded with the drafter of the checkout that records it: record before a
change, replay after it.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import statistics
import time
from pathlib import Path

from benchmarks import engine_grpo as g
from benchmarks.engine_run import run_engine
from services.common.traces import read_traces
from services.rollout.drafter import HistoDrafter
from services.rollout.engine import LLMEngine

_CALLS = ("start_request", "add_tokens", "propose", "record_acceptance", "stop_request")


def _history() -> tuple[list, dict[str, list[list[int]]]]:
    records = read_traces(g.TRACES)
    last = max(r.epoch for r in records)
    history: dict[str, list[list[int]]] = {}
    for r in records:
        if r.epoch < last:
            history.setdefault(r.prompt_id, []).append([int(t) for t in r.token_ids])
    return records, history


def _drafter(history: dict[str, list[list[int]]]) -> HistoDrafter:
    d = HistoDrafter()
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


def replay(log: list[tuple]) -> tuple[list[tuple[int, float]], dict[str, float], int]:
    """(batch size, seconds) per engine step, seconds per method, and the number of
    drafts that differ from the recorded ones."""
    drafter = _drafter(_history()[1])
    steps: list[tuple[int, float]] = []
    per_method = dict.fromkeys(_CALLS, 0.0)
    mismatches, batch, spent = 0, 0, 0.0
    clock = time.perf_counter
    gc.collect()
    for name, args, kwargs, expected in log:
        method = getattr(drafter, name)
        if name == "propose":
            if batch:
                steps.append((batch, spent))
            batch, spent = len(args[0]), 0.0
        t0 = clock()
        out = method(*args, **kwargs)
        elapsed = clock() - t0
        spent += elapsed
        per_method[name] += elapsed
        if name == "propose":
            mismatches += sum(a != b for a, b in zip(out, expected)) + abs(len(out) - len(expected))
    if batch:
        steps.append((batch, spent))
    return steps, per_method, mismatches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--log", default="/tmp/drafter_steps.pkl", help="the recorded calls")
    parser.add_argument("--record", action="store_true", help="record the log anew (else: if missing)")
    parser.add_argument("--model", default="models/tiny")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="replays; the fastest is reported")
    args = parser.parse_args()
    path = Path(args.log)
    if args.record or not path.exists():
        record(path, args.model, args.prompts, args.samples, args.max_tokens)
    log = pickle.loads(path.read_bytes())
    best = None
    for _ in range(args.rounds):
        steps, per_method, mismatches = replay(log)
        total = sum(s for _, s in steps)
        if best is None or total < best[0]:
            best = (total, steps, per_method, mismatches)
    total, steps, per_method, mismatches = best
    big = [s for n, s in steps if n >= 100]
    print(f"{len(steps)} steps, {sum(n for n, _ in steps)} sequence-steps, drafter total {total * 1e3:.0f} ms")
    print(f"per step: mean {total / len(steps) * 1e3:.3f} ms; steps with >= 100 sequences ({len(big)}): "
          f"mean {statistics.fmean(big) * 1e3 if big else 0:.3f} ms, "
          f"median {statistics.median(big) * 1e3 if big else 0:.3f} ms")
    print(f"per sequence-step: {total / sum(n for n, _ in steps) * 1e6:.1f} us")
    print("per method (ms): " + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in per_method.items()))
    print(f"drafts different from the recorded ones: {mismatches}")


if __name__ == "__main__":
    main()
