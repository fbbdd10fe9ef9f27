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


class OracleLengths(LengthModel):
    """Knows every sample's true length: the reference no real predictor can beat."""

    def __init__(self, true_len: dict[str, int]) -> None:
        super().__init__()
        self.true_len = true_len

    def predict(self, request, use_history: bool = True) -> float:
        return float(self.true_len[request.key])


ORACLE = {"runaway_guard": float("inf")}  # rhymerl, longest true length first


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
                ("vs oracle", "makespan_vs_oracle", ".3f"), ("migrations", "migrations", ".0f"), ("re-prefill tok", "reprefill_tokens", ".0f"),
                ("sim wall s", "sim_wall_s", ".1f")]
MULTI_COLUMNS = [("policy", "policy", "s"), ("steps", "steps", "d"), ("total s", "makespan_s", ".1f"),
                 ("vs static", "makespan_s_vs_static", ".3f"), ("fleet bubble", "bubble_ratio", ".3f"),
                 ("migrations", "migrations", ".0f"), ("stale-start samples", "stale_start_samples", ".0f"),
                 ("mixed-version samples", "mixed_version_samples", ".0f"), ("seeds", "seeds", "d")]


def oracle_bound(step, cost: CostCurve, num_workers: int, capacity: int) -> dict:
    """The oracle lower bound of one step: true lengths known, perfect packing.

    makespan >= max(longest single request, fleet work / workers), where a request alone
    on a worker takes prefill(prompt) + length x forward(1 token) (a sequence is
    sequential: no schedule can split it), and the fleet work is every request at the
    cheapest per-token cost the curve allows: decode tokens in a full batch of
    ``capacity`` sequences, forward(capacity) / capacity each, and prompt tokens at the
    curve's smallest slope (a prefill riding in a decode forward adds at least that per
    token). The bubble bound (same
    definition as the policies': idle worker-seconds / worker-seconds) is what is left
    idle if every request ran alone on a worker for its whole length (the most busy
    worker-time a set of requests can produce): max(0, 1 - sum(alone) / (workers x
    makespan)); perfect packing can end every request at the makespan, so the tail bound
    is 0. ``idle_capacity`` is the share of the fleet's full-batch decode capacity that
    the bound leaves unused: what one unsplittable long request costs, whatever the policy.
    """
    per_token_full = cost.forward_s(capacity) / capacity
    xs, ys = cost.num_tokens, cost.ms
    min_slope_s = min((y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:])) / 1000.0
    alone, work = [], 0.0
    for request in step.requests:
        length = step.true_len[request.key]
        alone.append(cost.forward_s(request.prompt_len) + length * cost.forward_s(1))
        work += request.prompt_len * min_slope_s + length * per_token_full
    makespan = max(max(alone), work / num_workers)
    return {"policy": "oracle", "workers": num_workers, "samples": len(step.requests), "steps": 1,
            "makespan_s": makespan, "bubble_ratio": max(0.0, 1.0 - sum(alone) / (num_workers * makespan)),
            "tail_s": 0.0, "idle_capacity": max(0.0, 1.0 - work / (num_workers * makespan)),
            "longest_request_s": max(alone), "work_bound_s": work / num_workers}


def trace_acceptance(path: str) -> tuple[SpecConfig, str]:
    """The simulated workers' draft acceptance: what our drafter achieved replaying the
    RL-loop traces (``benchmarks.drafter_bench``: mean accepted draft tokens per verify
    at its best fixed draft length), as a per-token acceptance rate."""
    measured = json.loads(Path(path).read_text())
    config = measured["rhymerl_best_config"]  # e.g. "all/16": sources / draft tokens
    num_draft = int(config.rsplit("/", 1)[1])
    mean_accepted = measured["rhymerl_mean_accepted"]
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


def live_rows(args) -> list[dict]:
    """Each policy on the in-process cluster (tests/e2e/cluster.py): ``--live-workers`` CPU
    workers with the tiny random model, a real redis-server, loopback gRPC. Per policy a
    fresh cluster runs two steps of the same prompts with different seeds; the first
    fills the history service, the second (epoch 1, history available) is reported from
    its StepSummary (the scheduler's own StepTimeline)."""
    import os
    import tempfile

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from rhymerl import Prompt, RolloutClient, SamplingParams

    from services.common.redis_server import EmbeddedRedis
    from tests.e2e.cluster import Cluster, save_tiny_model

    prompts = [Prompt(f"p{i}", [2 + (7 * i + 3 * j) % 90 for j in range(6)]) for i in range(args.live_prompts)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="sched-live-") as tmp, EmbeddedRedis() as redis:
        model_dir = save_tiny_model(Path(tmp) / "tiny")
        for policy in POLICIES:
            cluster = Cluster(model_dir=model_dir, redis_url=redis.url, num_workers=args.live_workers,
                              policy=policy, chunk_tokens=args.live_chunk, speculative=False,
                              device=args.live_device).start()
            try:
                with RolloutClient(cluster.address, timeout_s=600) as client:
                    for epoch in range(2):
                        sampling = SamplingParams(temperature=1.0, max_tokens=args.live_max_tokens, seed=1 + epoch)
                        started = time.perf_counter()
                        result = client.rollout(f"{policy}-e{epoch}", prompts, n=args.n_live, sampling=sampling)
                        wall = time.perf_counter() - started
            finally:
                cluster.stop()
            s = result.summary
            lengths = sorted(len(x.token_ids) for x in result.samples)
            median = lengths[len(lengths) // 2]
            heavy = lengths[-1] >= 20 * median
            rows.append({"policy": policy, "workers": args.live_workers,
                         "workload": "heavy_tail" if heavy else "tiny_model", "mode": "live",
                         "makespan_s": s.makespan_s, "bubble_ratio": s.bubble_ratio, "tail_s": s.tail_time_s,
                         "samples": len(result.samples), "migrations": s.num_migrations, "wall_s": wall,
                         "median_len": median, "max_len": lengths[-1],
                         "generated_tokens": s.num_generated_tokens, "seeds": 1})
            print(f"live {policy}: makespan {s.makespan_s:.2f} s, bubble {s.bubble_ratio:.3f}, "
                  f"tail {s.tail_time_s:.2f} s, {len(result.samples)} samples (median {median}, max "
                  f"{lengths[-1]} tokens)", flush=True)
    return rows


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
        rows += live_rows(args)
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


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets per (workload, fleet >= 64) where static has >= 40% bubble."""
    out = []
    for r in rows:
        if r["policy"] != "rhymerl" or r["mode"] != "sim" or r["workers"] < 64:
            continue
        same = {x["policy"]: x for x in rows if x["mode"] == "sim" and x["workload"] == r["workload"]
                and x["workers"] == r["workers"]}
        static, oracle = same["static"], same["oracle"]
        out.append({"workload": r["workload"], "workers": r["workers"],
                    "static_bubble": static["bubble_ratio"], "qualifies": static["bubble_ratio"] >= 0.4,
                    "bubble": r["bubble_ratio"], "bubble_met": r["bubble_ratio"] <= 0.05,
                    "makespan_vs_oracle": r["makespan_s"] / oracle["makespan_s"],
                    "makespan_met": r["makespan_s"] <= 1.15 * oracle["makespan_s"],
                    "tail_reduction": 1.0 - r["tail_s"] / static["tail_s"],
                    "tail_met": r["tail_s"] <= 0.25 * static["tail_s"]})
    return out


def render_markdown(summary: dict, acc_table: str) -> str:
    c = summary["config"]
    parts = [
        "# Scheduler: placement policies in the fleet simulator (and live)\n",
        (f"Command: `{summary['command']}` (OMP_NUM_THREADS=1), commit {summary['commit']}, "
         f"{summary['wall_s']:.0f} s wall. Device: {summary['device']}.\n"),
        (f"Simulated batch: {c['samples_per_worker']} samples per worker in groups of n={c['n']}, capacity "
         f"{c['capacity']} sequences per worker, {c['model']} H100 cost curve (weights only: attention time "
         f"not modelled), event quantum {c['quantum']} s; {c['seeds']} seeds averaged up to {c['seeds_up_to']} workers, one "
         "above.\n"),
        "Workloads:\n",
        *[f"- `{name}`: {d['source']}, epoch {d['epoch']} (earlier epochs are history); median "
          f"{d['median_len']} tokens, longest {d['max_len']} ({d['max_over_median']:.1f}x the median), "
          f"{d['share_ge_20x_median']:.2%} of samples >= 20x the median."
          for name, d in summary["workloads"].items()],
        "",
    ]
    for name in summary["workloads"]:
        rows = [r for r in summary["rows"] + summary["sections"].get(name, [])
                if r["workload"] == name and r["mode"] == "sim"]
        parts.append(f"## {name} (sim)\n\n{table(rows, MAIN_COLUMNS)}\n")
    live = [r for r in summary["rows"] if r["mode"] == "live"]
    if live:
        parts.append("## Live (real CPU workers, tiny random model)\n\n" + table(live, LIVE_COLUMNS) + "\n")
    if summary["targets"]:
        parts.append("## Targets (rhymerl, simulated, 64+ workers)\n\n" + table(summary["targets"], TARGET_COLUMNS)
                     + "\n\n" + target_verdict(summary["targets"]) + "\n")
    titles = summary["section_titles"]
    for name, rows in summary["sections"].items():
        if name in summary["workloads"]:
            continue  # drawn with the workloads above
        columns = MULTI_COLUMNS if name == "cross_step" else MAIN_COLUMNS
        parts.append(f"## {titles.get(name, name)}\n\n{table(rows, columns)}\n")
    parts.append(f"## Length model accuracy (rhymerl's predictions at step start)\n\n{acc_table}\n")
    parts.append(NOTES)
    return "\n".join(parts)


def target_verdict(rows: list[dict]) -> str:
    """The issue's targets, stated from the measured rows (nothing hand-written)."""
    lines = []
    for workload in sorted({r["workload"] for r in rows}):
        mine = [r for r in rows if r["workload"] == workload]
        qualifying = [r for r in mine if r["qualifies"]]
        fleets = ", ".join(str(r["workers"]) for r in qualifying) or "none"
        lines.append(f"- `{workload}`: static has >= 40% bubble at {fleets} workers.")
        for key, what in (("bubble_met", "bubble <= 5%"), ("makespan_met", "makespan <= 1.15x oracle"),
                          ("tail_met", "tail >= 75% below static")):
            met = [r for r in mine if r[key]]
            lines.append(f"  - {what}: met at {len(met)} of {len(mine)} fleet sizes "
                         f"({', '.join(str(r['workers']) for r in met) or 'none'}).")
    return "\n".join(lines)


LIVE_COLUMNS = [("workers", "workers", "d"), ("policy", "policy", "s"), ("workload", "workload", "s"),
                ("samples", "samples", "d"), ("median tok", "median_len", "d"), ("max tok", "max_len", "d"),
                ("makespan s", "makespan_s", ".2f"), ("bubble", "bubble_ratio", ".3f"), ("tail s", "tail_s", ".2f"),
                ("migrations", "migrations", "d")]
TARGET_COLUMNS = [("workload", "workload", "s"), ("workers", "workers", "d"),
                  ("static bubble", "static_bubble", ".3f"), ("bubble", "bubble", ".3f"),
                  ("<= 0.05", "bubble_met", ""), ("makespan / oracle", "makespan_vs_oracle", ".3f"),
                  ("<= 1.15", "makespan_met", ""), ("tail cut vs static", "tail_reduction", ".1%"),
                  (">= 75%", "tail_met", "")]

NOTES = """## How the oracle is computed

The `oracle` rows are a lower bound, not a schedule (true lengths known, perfect packing):

- makespan >= max(longest single request, fleet work / workers). A request alone on a worker
  takes prefill(prompt) + length x forward(1 token): a sequence is sequential, no schedule
  splits it. Fleet work counts every decode token at the cheapest per-token cost of the curve
  (a full batch of `capacity` sequences) and every prompt token at the curve's smallest slope.
- bubble >= max(0, 1 - sum(each request alone) / (workers x makespan)): the most busy
  worker-time the requests can produce is each running alone; it is 0 here.
- tail >= 0: perfect packing can end every request at the makespan.

## What each workload shows

- `heavy_tail`: a sample's length is mostly its prompt's (RhymeRL: few prompts change length
  rank between epochs), and 3% of prompts jump each epoch. At 256 samples per worker and 8
  running at once, the fleet's work, not one sample, sets the floor, so a bubble near 0 is
  possible. rhymerl sends each group's first sample ahead (a scout): a prompt whose length
  changed shows it within a chunk, and its siblings are pulled forward before they can start
  late. At 4,096 workers a step holds 1M samples and its makespan is set by one or two samples
  4-5 sigma above their own group's median that started in the step's last fifth;
  `python -m benchmarks.prediction_limit` (results/prediction_limit.md) runs the same policy
  with each prompt's true length law as its history, to separate what better prediction
  could win from what no scheduler without foresight can; results/prediction_limit_4096.md
  has three seeds at 4,096 workers, where the rows above run one.
- `heavy_tail_runaways`: the same plus 1% of samples that loop to max_tokens at random. A
  runaway looks like its siblings until it outgrows its prompt's history, so a policy without
  foresight finds the last runaways only when most of the step's work is done, and each still
  needs about 84 s after that. The oracle knows them from the start; no history does. rhymerl
  runs every exposed runaway first (its prediction jumps to max_tokens), which keeps the
  bubble low, but its makespan stays near "the step without runaways + one runaway".
- `traces`: the recorded RL-loop traces, tiled; short responses (median under 100 tokens), so
  prefills and the event quantum are a visible share of the step.
- The earlier shape, `--samples-per-worker 32`, puts one 16K-token sample at 3.6x a worker's
  full-batch share of the work: that sample is the floor, and most of the fleet idles under
  any schedule that does not hold work back just to look busy.
- `static` pins each prompt's group to one worker, as veRL's even split of a batch does.

## How to read these numbers

- Simulated, not measured on GPUs: worker speed is the forward-time curve of docs/cost-model.md
  (weight matrices only). A migration is charged a re-prefill of prompt + generated tokens
  on the destination; resuming on the same worker is free (prefix cache).
- The bubble counts a worker as busy while it runs at least one sequence (the issue's
  definition). On this cost curve a sequence decodes almost as fast alone as in a batch of
  8, so a worker running one sequence is "busy" while most of its batch is empty.
- Live rows: real workers (tiny random model, CPU) through the real scheduler; their
  lengths come from the random model and are not heavy-tailed unless the table says so.
  They show the whole path working and the scheduler's own metrics, not placement
  quality: the in-process workers are threads of one Python process, and with a tiny
  model an engine step is mostly Python, so the workers barely run in parallel. A policy
  that leaves workers idle puts more sequences in each step of the busy ones, takes
  fewer steps in all and finishes sooner (histopipe, bubble 0.3, at about half the others'
  makespan with 4 workers; with `--live-workers 2` all four policies land within 15%).
  Placement quality is what the simulated rows measure. The live GPU run in
  `make bench-gpu` uses the same in-process cluster, so it shares this caveat in part
  (the kernels run in parallel; the Python between them does not).
"""


if __name__ == "__main__":
    sys.exit(main())
