"""Which placement policy finishes a GRPO step soonest, from 8 to 4,096 workers?

Every policy object the live scheduler can run (static, seer, histopipe, rhymerl) is
driven by the discrete-event simulator (services/scheduler/simulator) on three workloads:
``traces`` (the recorded RL-loop traces, benchmarks/data/tiny_grpo_service.npz, tiled to the
fleet), ``heavy_tail`` (synthetic, per-prompt lognormal lengths drifting across epochs,
3% of prompts jumping per epoch, the longest >= 20x the median) and
``heavy_tail_runaways`` (the same plus ``--runaway`` of samples looping to max_tokens at
random: what no history foresees). Per fleet size a GRPO batch of
``--samples-per-worker`` samples per worker (default 256 with 8 running at once: Seer's
production shape, hundreds of requests per instance and KV-limited concurrency), the
step simulated being epoch 3 with the earlier epochs as history. Worker speed is the
H100 cost curve (docs/cost-model.md) of ``--model``. Next to the policies, an ``oracle`` lower bound
(see ``oracle_bound``).

Rows (benchmarks/results/scheduler.json ``"rows"``): policy, workers, workload, mode
(sim or live), makespan_s, bubble_ratio (idle worker-seconds / worker-seconds from the
step's first dispatch to its last result), tail_s (last 10% of samples), plus
migrations, re-prefilled tokens and ratios. ``--live`` adds every policy on real CPU
workers running the tiny model (mode "live"); ``--extra`` adds first-epoch, speculative
and cross-step sections at 64 workers.

    python -m benchmarks.scheduler_bench [--workers 8,64,512,4096] [--live] [--extra]
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path

from benchmarks.provenance import cpu_name, git_commit
from benchmarks.scheduler_live import live_rows
from benchmarks.scheduler_oracle import ORACLE, OracleLengths, oracle_bound
from benchmarks.scheduler_report import (
    MAIN_COLUMNS,
    MULTI_COLUMNS,
    render_markdown,
    table,
    targets,
)
from services.common.cost_curve import CostCurve
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
ROW_WORKLOADS = ("heavy_tail", "traces")  # the workloads of the "rows"
EPOCH = 3  # the simulated step; epochs 0..2 are its history


def heavy_tail(args, num_workers: int, seed: int, runaway: float = 0.0, epochs: int = EPOCH + 1) -> Workload:
    """The synthetic heavy-tailed workload sized to the fleet: ``--samples-per-worker``
    samples per worker in groups of ``--n``; ``runaway`` of them loop to max_tokens."""
    return synthetic_workload(num_workers * args.samples_per_worker // args.n, n=args.n, num_epochs=epochs,
                              max_tokens=args.max_tokens, seed=seed, median_len=args.median, runaway_prob=runaway)


def seeds_for(args, num_workers: int) -> range:
    """``--seeds`` seeds on fleets up to ``--seeds-up-to`` workers, one above (minutes each)."""
    return range(args.seed, args.seed + (args.seeds if num_workers <= args.seeds_up_to else 1))


def simulate(args, workload: Workload, num_workers: int, policy: str, epochs: list[int],
             spec: SpecConfig | None = None, overlap: bool = False, oracle: bool = False,
             known_law: int = 0, **policy_kw) -> dict:
    """One run: returns its metrics as a flat dict (the JSON row). ``known_law=k``
    replaces each step's history by k draws per prompt from the law its samples come
    from (``Workload.known_law_history``)."""
    steps = [workload.step(e, history_lag=1 if overlap else 0) for e in epochs]
    if known_law:
        for epoch, step in zip(epochs, steps):
            step.history = workload.known_law_history(epoch, known_law, seed=args.seed)
    if oracle:
        policy_kw = {**policy_kw, **ORACLE}
    sim = Simulator(make_policy(policy, **policy_kw), CostCurve.h100(args.model), num_workers,
                    args.capacity, spec=spec, quantum_s=args.quantum, overlap=overlap)
    lengths = OracleLengths({k: v for s in steps for k, v in s.true_len.items()}) if oracle else LengthModel()
    result = sim.run(steps, lengths)
    first = result.steps[0] if len(epochs) == 1 else result.fleet
    acc = accuracy(result.predicted, result.actual)
    return {
        "policy": ("oracle" if oracle else policy) + ("(cross_step)" if policy_kw.get("cross_step") else "")
        + ("+overlap" if overlap else "") + (f"(known law x{known_law})" if known_law else ""),
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
    """``simulate`` averaged over seeds: ``--seeds`` of them on fleets up to ``--seeds-up-to`` workers
    (small fleets hold few runaways, so one seed is noise), one seed above."""
    rows = [simulate(args, make_workload(seed), num_workers, policy, epochs, **kw)
            for seed in seeds_for(args, num_workers)]
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


def trace_acceptance(path: str) -> tuple[SpecConfig, str]:
    """The simulated workers' draft acceptance: what our drafter achieved replaying the
    RL-loop traces (``benchmarks.drafter_bench``: mean accepted draft tokens per verify
    at its best fixed draft length), as a per-token acceptance rate.

    The fixed lengths, not the product's adaptive row: the simulator chooses each batch's
    draft length itself (``SpecConfig``), so it needs the acceptance per drafted token,
    which an adaptive run's shortened drafts would understate."""
    measured = json.loads(Path(path).read_text())
    fixed = measured["rhymerl_mean_accepted_fixed"]  # draft tokens -> mean accepted drafts per verify
    length, mean_accepted = max(fixed.items(), key=lambda item: item[1])
    num_draft = int(length)
    alpha = SpecConfig.alpha_from_mean_accepted(1.0 + mean_accepted, num_draft)
    return SpecConfig(alpha=alpha, max_draft=num_draft), (
        f"acceptance from the traces ({mean_accepted:.2f} draft tokens accepted per verify at {num_draft} "
        f"drafts, {measured['traces']}, commit {measured['git_commit']}: alpha {alpha:.2f})")


def oracle_mean(args, make_workload, num_workers: int, epoch: int) -> dict:
    rows = [oracle_bound(make_workload(seed).step(epoch), CostCurve.h100(args.model), num_workers,
                         args.capacity) for seed in seeds_for(args, num_workers)]
    mean = dict(rows[0])
    for key in ("makespan_s", "bubble_ratio", "tail_s", "idle_capacity", "longest_request_s", "work_bound_s"):
        mean[key] = sum(r[key] for r in rows) / len(rows)
    mean["seeds"] = len(rows)
    return mean


def length_stats(workload: Workload, epoch: int) -> dict:
    lengths = sorted(x for epochs in workload.lengths.values() if epoch < len(epochs) for x in epochs[epoch])
    median = lengths[len(lengths) // 2]
    return {"median_len": median, "max_len": lengths[-1], "max_over_median": lengths[-1] / max(1, median),
            "share_ge_20x_median": sum(x >= 20 * median for x in lengths) / len(lengths)}



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", default="8,64,512,4096")
    parser.add_argument("--samples-per-worker", type=int, default=256)
    parser.add_argument("--n", type=int, default=16, help="samples per prompt (GRPO group)")
    parser.add_argument("--capacity", type=int, default=8, help="sequences a worker runs at once")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--median", type=float, default=600.0, help="heavy_tail: median scale of a prompt")
    parser.add_argument("--runaway", type=float, default=0.01,
                        help="heavy_tail_runaways: share of samples that loop to max_tokens (0: leave it out)")
    parser.add_argument("--model", default="7B", choices=["0.5B", "1.5B", "7B"])
    parser.add_argument("--quantum", type=float, default=0.1, help="simulator event batching, seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=3, help="seeds averaged on fleets of <= --seeds-up-to workers")
    parser.add_argument("--seeds-up-to", type=int, default=512, help="larger fleets run one seed (minutes each)")
    parser.add_argument("--traces", default="benchmarks/data/tiny_grpo_service.npz", help="trace files")
    parser.add_argument("--extra", action="store_true",
                        help="also: first epoch, speculative decoding, cross-step overlap (64 workers)")
    parser.add_argument("--drafter-results", default="benchmarks/results/drafter.json",
                        help="--extra: the draft acceptance measured on the traces (benchmarks.drafter_bench)")
    parser.add_argument("--live", action="store_true", help="also run every policy on real CPU workers")
    parser.add_argument("--live-workers", type=int, default=4)
    parser.add_argument("--live-device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the live workers share one GPU")
    parser.add_argument("--live-prompts", type=int, default=12)
    parser.add_argument("--n-live", type=int, default=4)
    parser.add_argument("--live-max-tokens", type=int, default=192)
    parser.add_argument("--live-chunk", type=int, default=32)
    parser.add_argument("--out", default="benchmarks/results/scheduler")
    args = parser.parse_args()
    started = time.perf_counter()
    fleets = [int(x) for x in args.workers.split(",")]
    mid = 64 if 64 in fleets else fleets[0]

    def heavy(num_workers: int, epochs: int = EPOCH + 1, runaway: float = 0.0):
        return lambda seed: heavy_tail(args, num_workers, seed, runaway, epochs)

    workloads = {"heavy_tail": (heavy, EPOCH)}
    if args.runaway > 0:
        workloads["heavy_tail_runaways"] = (lambda w: heavy(w, runaway=args.runaway), EPOCH)
    trace_files = sorted(glob.glob(args.traces))
    traced = trace_workload(trace_files) if trace_files else None
    if traced is not None:
        group_size = max(len(epochs[0]) for epochs in traced.lengths.values())
        t_epoch = min(EPOCH, traced.num_epochs - 1)
        workloads["traces"] = (lambda w: (lambda seed, w=w: traced.take(
            max(1, w * args.samples_per_worker // group_size))), t_epoch)
    rows: list[dict] = []
    describe = {}
    for name, (make, epoch) in workloads.items():
        describe[name] = {"source": make(mid)(args.seed).source, "epoch": epoch,
                          **length_stats(make(mid)(args.seed), epoch)}
        print(f"\n## {name}: {describe[name]}", flush=True)
        for w in fleets:
            group = [simulate_mean(args, make(w), w, p, [epoch]) for p in POLICIES]
            group.append(oracle_mean(args, make(w), w, epoch))
            for row in with_ratios(group):
                row.update(workload=name, mode="sim")
                if row["policy"] != "oracle":
                    oracle = group[-1]["makespan_s"]
                    row["makespan_vs_oracle"] = row["makespan_s"] / oracle
            print(table(group, MAIN_COLUMNS), flush=True)
            rows += group
    sections: dict[str, list[dict]] = {}
    titles: dict[str, str] = {}
    if args.extra:
        def run_section(name: str, title: str, groups) -> None:
            print(f"\n## {title}", flush=True)
            titles[name] = title
            out = []
            for group in groups:
                out += with_ratios(group)
                print(table(group, MULTI_COLUMNS if name == "cross_step" else MAIN_COLUMNS), flush=True)
            sections[name] = out

        run_section("first_epoch", "First epoch (no history), heavy_tail",
                    [[simulate_mean(args, heavy(mid), mid, p, [0]) for p in POLICIES]])
        spec, source = trace_acceptance(args.drafter_results)
        run_section("speculative", f"Speculative decoding, heavy_tail: {source}",
                    [[simulate_mean(args, heavy(mid), mid, p, [EPOCH], spec=spec) for p in POLICIES]])
        multi = heavy(mid, epochs=6)
        run_section("cross_step", f"Four consecutive steps on {mid} workers: sync vs cross-step", [[
            *[simulate_mean(args, multi, mid, p, [2, 3, 4, 5]) for p in POLICIES],
            simulate_mean(args, multi, mid, "rhymerl", [2, 3, 4, 5], overlap=True),
            simulate_mean(args, multi, mid, "rhymerl", [2, 3, 4, 5], overlap=True, cross_step=True)]])
    if args.live:
        print(f"\n## Live: {args.live_workers} {args.live_device} workers, tiny random model", flush=True)
        rows += live_rows(args, POLICIES)
    acc_rows = [{"workload": r["workload"], "workers": r["workers"], "samples": r["samples"],
                 "spearman": r["spearman"], "mae_tokens": r["mae_tokens"], "mre": r["mre"]}
                for r in rows if r["policy"] == "rhymerl" and r["mode"] == "sim"]
    acc_table = table(acc_rows, [("workload", "workload", "s"), ("workers", "workers", "d"),
                                 ("samples", "samples", "d"), ("Spearman", "spearman", ".3f"),
                                 ("MAE tokens", "mae_tokens", ".0f"), ("mean rel. error", "mre", ".3f")])
    print("\n## Length model (predictions at step start)\n" + acc_table)
    total = time.perf_counter() - started
    command = "python -m benchmarks.scheduler_bench " + " ".join(sys.argv[1:])
    summary = {
        "command": command.strip(),
        "device": f"simulated fleet of H100 workers ({args.model} cost curve, docs/cost-model.md) on one CPU core: {cpu_name()}"
        + (f"; live rows: in-process {args.live_device} workers on the same machine" if args.live else ""),
        "commit": git_commit(), "wall_s": total,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "workloads": describe, "targets": targets(rows),
        # the results format: "rows" hold the traces and heavy_tail workloads (and
        # live); the runaway variant goes with the other sections
        "rows": [r for r in rows if r["mode"] == "live" or r["workload"] in ROW_WORKLOADS],
        "sections": {**{name: [r for r in rows if r["mode"] == "sim" and r["workload"] == name]
                        for name in describe if name not in ROW_WORKLOADS}, **sections},
        "section_titles": titles,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    out.with_suffix(".md").write_text(render_markdown(summary, acc_table))
    print(f"\nwrote {out}.md and {out}.json in {total:.0f} s")
    return 0



if __name__ == "__main__":
    sys.exit(main())
