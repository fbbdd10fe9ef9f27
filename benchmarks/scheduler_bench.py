"""Which placement policy finishes a GRPO step soonest, from 8 to 4,096 workers?

Every policy object the live scheduler can run (static, seer, histopipe, rhymerl) is
driven by the discrete-event simulator (services/scheduler/simulator) over the same
workload: per fleet size, a GRPO batch of ``--samples-per-worker`` samples per worker
(groups of n), true lengths from a heavy-tailed synthetic generator whose per-prompt
lengths drift slowly across epochs (or from recorded traces, tiled to the fleet), the
step simulated being epoch 3 with epochs 0-2 as history. Worker speed is the DESIGN.md
H100 cost curve of ``--model``; a worker runs at most ``--capacity`` sequences at once.

Reported per fleet and policy: makespan, bubble ratio (idle worker-seconds / worker-
seconds), tail time (last 10% of samples), migrations and re-prefilled tokens, ratios
against static; then the same on a workload without runaways, on a first epoch (no
history), with speculative decoding, and over four consecutive steps with and without
cross-step overlap; and the length model's accuracy.

    python -m benchmarks.scheduler_bench [--workers 8,64,512,4096] [--traces GLOB]
"""

from __future__ import annotations

import argparse
import glob
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from services.scheduler.cost_model import CostModel
from services.scheduler.length_model import LengthModel, accuracy
from services.scheduler.policies import make_policy
from services.scheduler.simulator import (
    Simulator,
    SpecConfig,
    Workload,
    synthetic_workload,
    trace_workload,
)

POLICIES = ["static", "seer", "histopipe", "rhymerl"]
EPOCH = 3  # the simulated step; epochs 0..2 are its history


class OracleLengths(LengthModel):
    """Knows every sample's true length: the reference no real predictor can beat."""

    def __init__(self, true_len: dict[str, int]) -> None:
        super().__init__()
        self.true_len = true_len

    def predict(self, request, use_history: bool = True) -> float:
        return float(self.true_len[request.request_id])


ORACLE = {"runaway_guard": float("inf"), "share_unknown": False}  # rhymerl, longest true length first


def simulate(args, workload: Workload, num_workers: int, policy: str, epochs: list[int],
             spec: SpecConfig | None = None, overlap: bool = False, oracle: bool = False, **policy_kw) -> dict:
    """One run: returns its metrics as a flat dict (the JSON row)."""
    steps = [workload.step(e, history_lag=1 if overlap else 0) for e in epochs]
    if oracle:
        policy_kw = {**policy_kw, **ORACLE}
    sim = Simulator(make_policy(policy, **policy_kw), CostModel.default(args.model), num_workers,
                    args.capacity, spec=spec, quantum_s=args.quantum, overlap=overlap)
    lengths = OracleLengths({k: v for s in steps for k, v in s.true_len.items()}) if oracle else LengthModel()
    result = sim.run(steps, lengths)
    first = result.steps[0] if len(epochs) == 1 else result.fleet
    acc = accuracy(result.predicted, result.actual)
    return {
        "policy": ("oracle" if oracle else policy) + ("(cross_step)" if policy_kw.get("cross_step") else "")
        + ("+overlap" if overlap else ""),
        "workers": num_workers, "samples": len(result.actual), "steps": len(epochs),
        "makespan_s": first.makespan_s, "bubble_ratio": first.bubble_ratio, "tail_s": first.tail_time_s,
        "migrations": result.num_migrations, "reprefill_tokens": result.reprefill_tokens,
        "chunks": result.num_chunks, "mixed_version_samples": result.num_mixed_version,
        "stale_start_samples": result.num_stale_start,
        "step_makespans_s": [s.makespan_s for s in result.steps],
        "spearman": acc.spearman, "mae_tokens": acc.mean_abs_error, "mre": acc.mean_rel_error,
        "sim_wall_s": result.wall_s,
    }


def simulate_mean(args, make_workload, num_workers: int, policy: str, epochs: list[int], **kw) -> dict:
    """``simulate`` averaged over seeds: ``--seeds`` of them on fleets up to 64 workers
    (small fleets hold few runaways, so one seed is noise), one seed above."""
    seeds = range(args.seed, args.seed + (args.seeds if num_workers <= 64 else 1))
    rows = [simulate(args, make_workload(seed), num_workers, policy, epochs, **kw) for seed in seeds]
    mean = dict(rows[0])
    for key, value in rows[0].items():
        if isinstance(value, (int, float)) and key not in ("workers", "samples", "steps"):
            mean[key] = sum(r[key] for r in rows) / len(rows)
    mean["seeds"] = len(rows)
    return mean


def with_ratios(rows: list[dict]) -> list[dict]:
    base = next((r for r in rows if r["policy"] == "static"), None)
    for row in rows:
        for key in ("makespan_s", "bubble_ratio", "tail_s"):
            row[f"{key}_vs_static"] = row[key] / base[key] if base and base[key] else None
    return rows


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(title for title, _, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join("-" if row.get(key) is None else format(row[key], fmt)
                              for _, key, fmt in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])


MAIN_COLUMNS = [("workers", "workers", "d"), ("policy", "policy", "s"), ("samples", "samples", "d"),
                ("seeds", "seeds", "d"),
                ("makespan s", "makespan_s", ".1f"), ("vs static", "makespan_s_vs_static", ".3f"),
                ("bubble", "bubble_ratio", ".3f"), ("vs static", "bubble_ratio_vs_static", ".3f"),
                ("tail s", "tail_s", ".1f"), ("vs static", "tail_s_vs_static", ".3f"),
                ("migrations", "migrations", ".0f"), ("re-prefill tok", "reprefill_tokens", ".0f"),
                ("sim wall s", "sim_wall_s", ".1f")]
MULTI_COLUMNS = [("policy", "policy", "s"), ("steps", "steps", "d"), ("total s", "makespan_s", ".1f"),
                 ("vs static", "makespan_s_vs_static", ".3f"), ("fleet bubble", "bubble_ratio", ".3f"),
                 ("migrations", "migrations", ".0f"), ("stale-start samples", "stale_start_samples", ".0f"),
                 ("mixed-version samples", "mixed_version_samples", ".0f"), ("seeds", "seeds", "d")]


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=False)
        return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "uncommitted"
    except OSError:
        return "uncommitted"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="8,64,512,4096")
    parser.add_argument("--samples-per-worker", type=int, default=32)
    parser.add_argument("--n", type=int, default=16, help="samples per prompt (GRPO group)")
    parser.add_argument("--capacity", type=int, default=8, help="sequences a worker runs at once")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--runaway", type=float, default=0.01, help="share of samples that loop to max_tokens")
    parser.add_argument("--model", default="7B", choices=["0.5B", "1.5B", "7B"])
    parser.add_argument("--quantum", type=float, default=0.1, help="simulator event batching, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=3, help="seeds averaged on fleets of <= 64 workers")
    parser.add_argument("--traces", default="benchmarks/data/*.npz", help="trace files (used when present)")
    parser.add_argument("--out", default="benchmarks/results/scheduler")
    args = parser.parse_args()
    started = time.perf_counter()
    fleets = [int(x) for x in args.workers.split(",")]
    mid = 64 if 64 in fleets else fleets[0]

    def workload(num_workers: int, runaway: float = args.runaway, epochs: int = 4):
        return lambda seed: synthetic_workload(num_workers * args.samples_per_worker // args.n, n=args.n,
                                               num_epochs=epochs, max_tokens=args.max_tokens, seed=seed,
                                               runaway_prob=runaway)

    sections: dict[str, list[dict]] = {}

    def run_section(name: str, title: str, make_rows) -> None:
        print(f"\n## {title}", flush=True)
        rows = []
        for group in make_rows():
            rows += with_ratios(group)
            print(table(group, MULTI_COLUMNS if name == "cross_step" else MAIN_COLUMNS), flush=True)
        sections[name] = rows

    run_section("main", f"One step (epoch {EPOCH}), heavy tail with {args.runaway:.0%} runaways", lambda: (
        [*(simulate_mean(args, workload(w), w, p, [EPOCH]) for p in POLICIES),
         *([simulate_mean(args, workload(w), w, "rhymerl", [EPOCH], oracle=True)] if w <= 512 else [])]
        for w in fleets))
    run_section("no_runaway", "One step, heavy tail, no runaways", lambda: (
        [*(simulate_mean(args, workload(w, runaway=0.0), w, p, [EPOCH]) for p in POLICIES),
         simulate_mean(args, workload(w, runaway=0.0), w, "rhymerl", [EPOCH], oracle=True)]
        for w in fleets if w <= 512))
    run_section("first_epoch", "First epoch (no history)", lambda: (
        [[simulate_mean(args, workload(mid), mid, p, [0]) for p in POLICIES]]))
    spec = SpecConfig(alpha=0.7, max_draft=16)
    run_section("speculative", "Speculative decoding (acceptance 0.7, draft length adapted to the batch)", lambda: (
        [[simulate_mean(args, workload(mid), mid, p, [EPOCH], spec=spec) for p in POLICIES]]))
    multi = workload(mid, epochs=6)
    run_section("cross_step", f"Four consecutive steps (epochs 2-5) on {mid} workers: sync vs cross-step", lambda: [[
        *[simulate_mean(args, multi, mid, p, [2, 3, 4, 5]) for p in POLICIES],
        simulate_mean(args, multi, mid, "seer", [2, 3, 4, 5], overlap=True),
        simulate_mean(args, multi, mid, "rhymerl", [2, 3, 4, 5], overlap=True),
        simulate_mean(args, multi, mid, "rhymerl", [2, 3, 4, 5], overlap=True, cross_step=True)]])
    trace_files = sorted(glob.glob(args.traces))
    if trace_files:
        try:
            traced = trace_workload(trace_files)
        except (ImportError, ValueError) as err:
            print(f"\n(traces {trace_files} not used: {err})")
        else:
            epoch = min(EPOCH, traced.num_epochs - 1)
            group_size = max(len(epochs[0]) for epochs in traced.lengths.values())
            tiled = traced.take(max(1, mid * args.samples_per_worker // group_size))
            run_section("traces", f"Trace lengths ({tiled.source}), epoch {epoch}", lambda: (
                [[simulate_mean(args, lambda seed: tiled, mid, p, [epoch]) for p in POLICIES]]))

    print("\n## Length model (history of 3 epochs + finished siblings; predictions at step start)")
    acc_rows = [{"workers": r["workers"], "samples": r["samples"], "spearman": r["spearman"],
                 "mae_tokens": r["mae_tokens"], "mre": r["mre"]}
                for r in sections["main"] if r["policy"] == "rhymerl"]
    acc_table = table(acc_rows, [("workers", "workers", "d"), ("samples", "samples", "d"),
                                 ("Spearman", "spearman", ".3f"), ("MAE tokens", "mae_tokens", ".0f"),
                                 ("mean rel. error", "mre", ".3f")])
    print(acc_table)
    total = time.perf_counter() - started
    command = "python -m benchmarks.scheduler_bench " + " ".join(sys.argv[1:])
    summary = {
        "device": f"simulated fleet of H100 workers ({args.model} cost curve, DESIGN.md) on one CPU core: {_cpu()}",
        "git_commit": _git_commit(), "command": command.strip(), "wall_s": total,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "workload": workload(fleets[0])(args.seed).source, "sections": sections,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    out.with_suffix(".md").write_text(render_markdown(summary, acc_table))
    print(f"\nwrote {out}.md and {out}.json in {total:.0f} s")
    return 0


def render_markdown(summary: dict, acc_table: str) -> str:
    c = summary["config"]
    parts = [
        "# Scheduler: placement policies in the fleet simulator\n",
        (f"Command: `{summary['command']}` (OMP_NUM_THREADS=1), commit {summary['git_commit']}, "
         f"{summary['wall_s']:.0f} s wall. Device: {summary['device']}.\n"),
        (f"Batch: {c['samples_per_worker']} samples per worker in groups of n={c['n']}, max_tokens "
         f"{c['max_tokens']}, capacity {c['capacity']} sequences per worker, {c['model']} H100 cost curve "
         f"(weights only: attention time not modelled), event quantum {c['quantum']} s. "
         f"Workload: {summary['workload']}.\n"),
    ]
    titles = {"main": "One step, heavy tail with runaways", "no_runaway": "One step, heavy tail, no runaways",
              "first_epoch": "First epoch (no history)", "speculative": "Speculative decoding (alpha 0.7)",
              "cross_step": "Four consecutive steps: sync vs cross-step overlap", "traces": "Trace lengths"}
    for name, rows in summary["sections"].items():
        columns = MULTI_COLUMNS if name == "cross_step" else MAIN_COLUMNS
        parts.append(f"## {titles.get(name, name)}\n\n{table(rows, columns)}\n")
    parts.append(f"## Length model accuracy (epoch {EPOCH}, 3 epochs of history)\n\n{acc_table}\n")
    parts.append(CAVEATS)
    return "\n".join(parts)


CAVEATS = """## How to read these numbers

- Simulated, not measured on GPUs: worker speed is the DESIGN.md forward-time curve
  (weight matrices only; attention over the KV cache is not modelled, so long contexts
  are too cheap here and re-prefills too). A migration is charged a re-prefill of prompt
  + generated tokens on the destination (no KV transfer pool); resuming on the same
  worker is free (prefix cache).
- Makespans are floored by the longest sample: 16,384 tokens at one token per 5.13 ms
  forward is 84 s. The `oracle` row (rhymerl's machinery fed the true lengths, longest
  first; up to 512 workers, to keep the run short) shows what perfect prediction would
  give; the gap to it is what hidden runaways and prediction noise cost each policy.
- `histopipe` is HistoPipe's placement tier only (predicted-work balancing, per-worker
  long-first queues, no chunks): without its in-step migration it starts the short
  groups, and the runaways hidden in them, last.
- Cross-step overlap lets the next step in as soon as the queue is empty while slots are
  free (bounded staleness 1): stale-start samples began before the policy update of
  their step (one version behind), mixed-version samples carry tokens of two versions.
"""


if __name__ == "__main__":
    sys.exit(main())
