"""Issue 24's targets for the compiled drafter on this machine's CPU, in seconds.

The same replays as `benchmarks.drafter_steps` (the engine's recorded calls) and
`benchmarks.drafter_bench` (the lockstep replay of each committed trace set), for the
compiled core alone, beside the crossing floor on the lockstep sets
(`drafter_replay.CrossingFloor`: the same calls with one empty crossing into the core each,
no drafting: what the clock, the calls and a ctypes crossing cost on this CPU). Every round
is reported, none picked: a target counts as met where it is met in every round. It takes
about ten seconds a round, so the GPU campaign (`deploy/gpu/launch.py`) runs it on the
GPU machine's CPU, where the drafter runs in production, beside its first part.

    python -m benchmarks.drafter_host [--rounds 3] [--out benchmarks/results]

Writes drafter_host.{md,json}: per replay and round, `drafter_replay.step_summary`'s
figures (µs per sequence per step over the steps with >= 16 sequences, the step's ms with
>= 100, the one-sequence step's p99), and the engine log's drafts checked against the
recorded ones. (The log was recorded on Python 3.11. On 3.12, the GPU machine's, the core
sums floats as 3.12's sum() does, as the reference does there, so a draft may differ from
the log where a rounding decides it: counted in `drafts_different_from_recorded`.)
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import platform
import sys
from pathlib import Path

from benchmarks import drafter_replay as R
from benchmarks import drafter_steps as S
from benchmarks.drafter_bench import COMMITTED, RHYMERL, configs
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table, write_results

ENGINE_LOG = "benchmarks/data/drafter_steps_grpo.pkl"
# issue 24: (figure, bound), each in step_summary's units
TARGETS = (("propose_p50", 3.0), ("propose_p99", 5.0), ("commit_p50", 3.0), ("step_ms_100plus", 0.6),
           ("one_seq_p99", 15.0))
KEYS = ("propose_p50", "propose_p99", "commit_p50", "commit_p99", "step_ms_100plus", "one_seq_p99",
        "num_steps_16plus", "num_steps_100plus", "num_one_seq_steps")


def engine_log_round(log: list) -> dict:
    """One replay of the engine's recorded calls through a fresh compiled drafter."""
    steps, _, mismatches, pauses = S.replay(log, "compiled")
    summary = R.step_summary(steps, pauses["gross"], pauses["count"], pauses["ns"])
    return {**{k: summary[k] for k in KEYS}, "drafts_different_from_recorded": mismatches}


def lockstep_round(traces: list, stop: int | None, make) -> dict:
    row = R.replay(traces, make, stop, "drafter_host")
    return {k: row["drafter_step_us"][k] for k in KEYS}


def met(rounds: list[dict]) -> dict[str, bool | None]:
    """Per target: met in every round (None: the replay has no such steps)."""
    out: dict[str, bool | None] = {}
    for key, bound in TARGETS:
        values = [r[key] for r in rounds]
        out[key] = None if any(v is None for v in values) else all(v <= bound for v in values)
    return out


def measure(rounds: int, sets: list[str]) -> list[dict]:
    """Per replay: its rounds (compiled core; on the lockstep sets, the floor's beside)."""
    log = pickle.loads(Path(ENGINE_LOG).read_bytes())
    replays = [{"replay": "engine log", "source": ENGINE_LOG, "compiled": [], "floor": None}]
    loaded = []
    for path in sets:
        traces = R.load_traces(path)
        loaded.append((traces, R.stop_token(traces)))
        replays.append({"replay": f"lockstep {Path(path).stem}", "source": path, "compiled": [], "floor": []})
    ours = configs(None)[RHYMERL]  # the product configuration, as drafter_bench replays it
    for _ in range(rounds):  # round after round, every replay in each (a slow spell hits them all alike)
        gc.collect()
        replays[0]["compiled"].append(engine_log_round(log))
        for entry, (traces, stop) in zip(replays[1:], loaded):
            entry["compiled"].append(lockstep_round(traces, stop, ours))
            entry["floor"].append(lockstep_round(traces, stop, R.CrossingFloor))
    for entry in replays:
        entry["targets_met"] = met(entry["compiled"])
    return replays


def _fmt(values: list, digits: int = 2) -> str:
    return " / ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values)


def table(replays: list[dict]) -> str:
    rows = []
    for e in replays:
        c = e["compiled"]
        row = {"replay": e["replay"]}
        for key, _ in TARGETS:
            mark = {True: " ✓", False: " ✗", None: ""}[e["targets_met"][key]]
            row[key] = _fmt([r[key] for r in c], 3 if key == "step_ms_100plus" else 2) + mark
        row["floor one-seq p99"] = _fmt([r["one_seq_p99"] for r in e["floor"]], 1) if e["floor"] else "n/a"
        rows.append(row)
    columns = [("replay", "replay", "{}")] + [(f"{k} (<= {b:g})", k, "{}") for k, b in TARGETS] \
        + [("floor one-seq p99", "floor one-seq p99", "{}")]
    return markdown_table(rows, columns)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--traces", nargs="*", default=COMMITTED, help="lockstep trace sets (default: the committed)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    R.check_trace_files(parser, args.traces)
    load_before = os.getloadavg()[0]
    replays = measure(args.rounds, args.traces)
    summary = {
        "replays": replays,
        "targets": dict(TARGETS),
        "rounds": args.rounds,
        "timing_clock": "time.thread_time_ns (CPU time of the replay thread), net of the garbage collector's pauses "
                        "inside the spans; every round reported",
        "garbage_collector": R.gc_policy(),
        "device": "cpu", "cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version(),
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "git_commit": git_commit("services/rollout/drafter", "benchmarks"),
        "command": "python -m benchmarks.drafter_host " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    text = table(replays)
    print(text)
    write_results(args.out, "drafter_host", summary,
        f"# The compiled drafter against issue 24's targets\n\nCommand: `{summary['command']}`, commit "
        f"{summary['git_commit']}, CPU: {summary['cpu']} ({summary['cores']} cores), Python {summary['python']}, "
        f"1-min load {load_before:.1f} -> {summary['load_average_1min'][1]:.1f}. Thread CPU time, net of the "
        f"garbage collector's pauses; µs per sequence per step over the steps with >= 16 sequences, the step's "
        f"ms with >= 100, the one-sequence step's p99 in µs; each round's figure in turn (✓: met in every "
        f"round). The floor: the same lockstep calls with one empty crossing into the core each, no "
        f"drafting.\n\n{text}\n")
    return summary


if __name__ == "__main__":
    R.worker_gc()
    main()
