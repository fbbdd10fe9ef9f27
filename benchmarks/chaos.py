"""Does the RL loop survive what a cluster does to it? A seeded fault campaign against the
services as separate processes on loopback.

    python -m benchmarks.chaos --seed 1 --faults 200 --steps 50    # the long one (make bench)
    python -m benchmarks.chaos --seed 1 --faults 10 --steps 6 --no-fair-share --out DIR   # make test's

1. Starts Redis (append-only file), history, the scheduler (rhymerl placement, chunks of
   8 tokens, step log in Redis) and 2 CPU workers on a tiny random model; version v of
   the weights is checkpoint v % 2 (two random weight sets).
2. The fault-free reference: every pool prompt x sample x seed under both weight sets.
3. The campaign: two trainers run steps (their own, colliding-id pairs, duplicates of
   each other's) while the fault thread (``chaos_faults.py``) kills and restarts
   processes, pushes weights and sends bad input. After every step: each (prompt,
   sample) delivered once, tokens identical to the reference, no hang past the step's
   deadline, and the services' memory sampled (bounded: ``--max-rss-mb``).
4. The memory soak (unless --soak-steps 0): the scheduler restarted with a small cap
   on the finished steps it keeps (``--soak-cap-mb``, by bytes only), then many steps
   of 1,024 samples, more than the cap holds; its RSS sampled throughout.
   ``scheduler_rss_over_cap``: the largest RSS above the RSS it had after warm-up
   steps (Python, gRPC: what no cap bounds), divided by the cap.
5. Fair share (unless --no-fair-share): a 4 x 4-sample step alone, then beside a
   16 x 4096 = 65,536-sample step; the scheduler's health latency meanwhile.
   ``--only-fair-share`` skips 2 and 3 (a quick look at the fair-share figure).
Writes <out>/chaos.md and chaos.json (seed, faults by kind, steps, samples, lost,
duplicated, hangs, identical_share, fair_share, reregister_s, soak, scheduler_rss_over_cap,
command, commit).

Sharded (``--shards N``): the same campaign, trainers and checks against a step router
in front of N scheduler shards (``services/router/local.py``: each shard its own
Redis (history, step log), history, scheduler and one CPU worker; a redis-server as the
shard registry). The faults (``SHARDED_KINDS``) kill a shard's scheduler mid-step (kill
-9 and SIGTERM), the router mid-step, a shard's worker, history or Redis, and push
weights, cancel and send bad input through the router. No soak and no fair share (both
measure one scheduler). Writes chaos_shards.{md,json}
(``shard_kills_mid_step``, ``groups_requeued``: the prompt groups the router took back
from the killed shards and ran elsewhere, ``router_kills_mid_step``, ``router_back_s``).

    python -m benchmarks.chaos --shards 2 --seed 1 --faults 40 --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import logging
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from rhymerl.v1 import common_pb2

from benchmarks.chaos_faults import KINDS, SHARDED_KINDS, Faults
from benchmarks.chaos_trainer import MAX_N, SEEDS, StepOutcome, StepPlan, Trainer, prompt_pool, run_step
from benchmarks.fair_share import measure_fair_share
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table
from services.local import LocalCluster
from services.router.local import ShardedCluster

log = logging.getLogger("chaos")
RESULTS = Path(__file__).resolve().parent / "results"


class Ledger:
    """What the trainers' steps delivered, checked against the reference as they end."""

    def __init__(self, reference: dict):
        self.reference, self.lock = reference, threading.Lock()
        self.steps = self.samples = self.lost = self.duplicated = self.hangs = self.identical = 0
        self.errors: list[str] = []
        self.mismatches: list[str] = []  # the first samples that differ from the reference, and how
        self.duplicates: list[str] = []  # the first samples delivered twice, and how
        self.step_seconds: list[float] = []

    def _differs(self, plan: StepPlan, s) -> str:
        if s.finish_reason == common_pb2.FINISH_REASON_ABORT:
            return f"aborted: {s.error}"
        if s.token_policy_versions:
            return f"versions {sorted(set(s.token_policy_versions))} in one sample"
        want = self.reference.get((s.policy_version % 2, plan.seed, s.prompt_id, s.sample_index))
        return "" if list(s.token_ids) == want else f"other tokens at version {s.policy_version}"

    def on_step(self, out: StepOutcome) -> None:
        plan = out.plan
        expected = {(p, k) for p in plan.prompts for k in range(plan.n)}
        differs = {key: self._differs(plan, s) for key, s in out.samples.items()}
        identical = sum(not d for d in differs.values())
        with self.lock:
            self.mismatches += [f"{plan.step_id} {key}: {d}" for key, d in differs.items() if d][:20 - len(
                self.mismatches)]
            self.duplicates += [f"{plan.step_id} {d}" for d in out.duplicates][:20 - len(self.duplicates)]
            self.steps += out.complete
            self.samples += len(out.samples)
            self.lost += len(expected - set(out.samples))
            self.duplicated += out.duplicated + len(set(out.samples) - expected)
            self.hangs += not out.complete and not out.error
            self.identical += identical
            self.step_seconds.append(out.seconds)
            if out.error:
                self.errors.append(f"{plan.step_id}: {out.error}")
        log.info("step %s: %d/%d samples, %d identical, %d attempts, %.1f s%s", plan.step_id, len(out.samples),
                 len(expected), identical, out.attempts, out.seconds, f" ERROR {out.error}" if out.error else "")


def reference_run(cluster: LocalCluster, checkpoints: list[Path]) -> dict:
    """Tokens of every pool prompt x sample x seed under both weight sets, fault-free;
    leaves the cluster on version 2 (checkpoint 0)."""
    from rhymerl import RolloutClient

    pool, reference = prompt_pool(), {}
    with RolloutClient(cluster.scheduler_address, timeout_s=300) as client:
        for version in (0, 1):
            if version:
                client.load_weights(version, str(checkpoints[1]))
            for seed in SEEDS:
                out = run_step(cluster.scheduler_address, StepPlan(f"reference/{version}/{seed}", pool, MAX_N, seed), 300)
                assert out.complete and not out.error, out.error
                for (pid, k), s in out.samples.items():
                    reference[(version, seed, pid, k)] = list(s.token_ids)
        client.load_weights(2, str(checkpoints[0]))
    return reference


def campaign(args, workdir: Path) -> dict:
    from tests.e2e.cluster import save_tiny_model  # the tiny random model of the e2e tests

    checkpoints = [save_tiny_model(workdir / f"weights{i}", seed=i) for i in (0, 1)]
    bad_payload = _nan_payload(checkpoints[0])
    worker_timeout = {"RHYMERL_SCHEDULER_WORKER_TIMEOUT_S": "120"}
    logs = args.log_dir or workdir / "logs"
    if args.shards:
        # 16 slots per worker: a step (up to 32 samples) exceeds one shard's window, so
        # groups wait in the router and the shard that finishes first takes the tail.
        cluster = ShardedCluster(model_dir=str(checkpoints[0]), num_shards=args.shards, workers_per_shard=1,
                                 chunk_tokens=8, max_num_seqs=16, log_dir=logs, extra_env=worker_timeout,
                                 separate_redis=True)
        services = ["router"] + [f"shard-{i}/{p}" for i in range(args.shards) for p in ("scheduler", "history", "redis")]
    else:
        cluster = LocalCluster(model_dir=str(checkpoints[0]), num_workers=2, policy="rhymerl", chunk_tokens=8,
                               log_dir=logs, separate_redis=True, extra_env=worker_timeout)
        services = ["scheduler", "history", "redis"]
    started = time.monotonic()
    with cluster:
        if args.only_fair_share:
            return {"fair_share": measure_fair_share(cluster), "duration_s": round(time.monotonic() - started, 1)}
        reference = reference_run(cluster, checkpoints)
        ledger, stop = Ledger(reference), threading.Event()
        faults = Faults(cluster, args.seed, args.faults, checkpoints, bad_payload, ledger.on_step,
                        args.step_deadline_s, SHARDED_KINDS if args.shards else KINDS)
        trainers = [Trainer(i, args.seed, cluster.scheduler_address, stop, args.step_deadline_s, ledger.on_step)
                    for i in range(2)]
        rss = Counter()
        for thread in (faults, *trainers):
            thread.start()
        while not (faults.done.is_set() and ledger.steps >= args.steps):
            for name in services:
                rss[name] = max(rss[name], cluster.rss_bytes(name))
            time.sleep(0.5)
        stop.set()
        for t in trainers:
            t.join(args.step_deadline_s + 30)
        if faults.error is not None:
            raise faults.error
        soak = memory_soak(cluster, args.soak_steps, args.soak_cap_mb << 20) if args.soak_steps and not args.shards \
            else None
        fair = measure_fair_share(cluster) if args.fair_share and not args.shards else None
    sharded = {"shards": args.shards, "shard_kills_mid_step": faults.mid_step["kill9_shard"]
               + faults.mid_step["sigterm_shard"], "groups_requeued": faults.groups_requeued,
               "router_kills_mid_step": faults.mid_step["kill9_router"]
               + faults.mid_step["sigterm_router"], "router_back_s": max(faults.router_back_s, default=None),
               } if args.shards else {}
    faults_by_kind = {k: v for k, v in sorted(faults.counts.items()) if ":" not in k}
    return {
        "seed": args.seed, "faults": faults_by_kind, "num_faults": sum(faults_by_kind.values()),
        "bad_inputs": {k.split(":", 1)[1]: v for k, v in sorted(faults.counts.items()) if ":" in k},
        "bad_input_mismatch": faults.bad_input_mismatch, "aborted_regenerated": faults.num_aborted_regenerated,
        "soak": soak, "scheduler_rss_over_cap": soak["rss_over_cap"] if soak else None,
        "steps": ledger.steps, "samples": ledger.samples,
        "lost": ledger.lost, "duplicated": ledger.duplicated, "hangs": ledger.hangs,
        "identical_share": ledger.identical / max(1, ledger.samples), "errors": ledger.errors,
        "mismatches": ledger.mismatches, "duplicates": ledger.duplicates,
        "fair_share": fair, "reregister_s": max(faults.reregister_s, default=None),
        "reregister_s_all": [round(s, 2) for s in faults.reregister_s],
        "max_rss_mb": {k: round(v / 2**20) for k, v in rss.items()},
        "memory_bounded": all(v <= args.max_rss_mb * 2**20 for v in rss.values()),
        "median_step_s": statistics.median(ledger.step_seconds) if ledger.step_seconds else None,
        "duration_s": round(time.monotonic() - started, 1), **sharded,
    }


def memory_soak(cluster: LocalCluster, num_steps: int, cap: int) -> dict:
    """The scheduler's memory over many steps, more than ``cap`` bytes of kept steps hold."""
    from rhymerl import Prompt, RolloutClient, SamplingParams

    _, env = cluster.commands["scheduler"]
    env.update(RHYMERL_SCHEDULER_MAX_RETAINED_BYTES=cap, RHYMERL_SCHEDULER_MAX_STEPS_RETAINED=1_000_000)
    cluster.kill("scheduler", signal.SIGTERM)
    cluster.restart("scheduler")
    cluster.wait_registered(120)
    pool = prompt_pool()
    # Long ids (the intake allows 256 bytes): each kept sample is ~0.6 KB, so a few dozen
    # steps of a CPU fleet fill the cap; a sample in flight shares its ids with its step.
    prompts = [Prompt(f"soak{i:03d}".ljust(200, "-"), pool[pid]) for i, pid in enumerate(sorted(pool) * 2)]
    params = SamplingParams(temperature=1.0, max_tokens=2, seed=3, logprobs=True, ignore_eos=True)
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], cluster.rss_bytes("scheduler"))
            time.sleep(0.05)

    started = time.monotonic()
    with RolloutClient(cluster.scheduler_address, timeout_s=300) as client:
        for i in range(3):  # warm-up: allocator pools, channels, imports
            client.rollout(f"soak/warmup{i}".ljust(200, "-"), prompts, n=64, sampling=params)
        baseline = cluster.rss_bytes("scheduler")
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            for i in range(num_steps):
                client.rollout(f"soak/{i:04d}".ljust(200, "-"), prompts, n=64, sampling=params)
        finally:
            done.set()
            sampler.join()
    return {"steps": num_steps, "samples_per_step": len(prompts) * 64, "cap_mb": round(cap / 2**20, 1),
            "baseline_rss_mb": round(baseline / 2**20, 1), "peak_rss_mb": round(peak[0] / 2**20, 1),
            "rss_over_cap": round((peak[0] - baseline) / cap, 3), "seconds": round(time.monotonic() - started, 1)}


def _nan_payload(checkpoint: Path) -> bytes:
    from safetensors.torch import save

    from services.rollout.loader import read_safetensors

    state = read_safetensors(str(next(checkpoint.glob("*.safetensors"))))
    name = sorted(state)[0]
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    return save(state)


def write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    name = "chaos_shards" if result.get("shards") else "chaos"
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    keys = ["seed", "num_faults", "steps", "samples", "lost", "duplicated", "hangs", "identical_share", "reregister_s",
            "max_rss_mb", "memory_bounded", "scheduler_rss_over_cap", "aborted_regenerated", "fair_share",
            "bad_input_mismatch", "duration_s"]
    if result.get("shards"):
        keys[1:1] = ["shards", "shard_kills_mid_step", "groups_requeued", "router_kills_mid_step", "router_back_s"]
    rows = [{"what": k, "value": json.dumps(result[k])} for k in keys]
    text = markdown_table(rows, [("", "what", "{}"), ("", "value", "{}")])
    faults = markdown_table([{"kind": k, "count": v} for k, v in result["faults"].items()],
                            [("fault", "kind", "{}"), ("count", "count", "{}")])
    title = f"Chaos campaign, {result['shards']} scheduler shards behind the router" if result.get("shards") \
        else "Chaos campaign"
    (out / f"{name}.md").write_text(
        f"# {title}\n\n`{result['command']}` at {result['commit']} on {result['device']}"
        f" (load average {result['load_average']} at the end)\n\n{text}\n\n## Faults injected\n\n{faults}\n")
    print(text)
    print(faults)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--faults", type=int, default=200, help="faults to inject")
    parser.add_argument("--steps", type=int, default=50, help="complete steps at least")
    parser.add_argument("--step-deadline-s", type=float, default=300.0, help="a step past this hung")
    parser.add_argument("--max-rss-mb", type=int, default=2048, help="the memory bound per service")
    parser.add_argument("--fair-share", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--soak-steps", type=int, default=40, help="steps of the memory soak (0: none)")
    parser.add_argument("--soak-cap-mb", type=int, default=16, help="the scheduler's cap on kept steps in the soak")
    parser.add_argument("--only-fair-share", action="store_true",
                        help="no campaign: only the fair-share measure (written to fair_share.{md,json})")
    parser.add_argument("--shards", type=int, default=0,
                        help="N > 0: a step router in front of N scheduler shards (no soak, no fair share)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.shards == 1 or args.shards < 0:
        parser.error("--shards: 0 (one scheduler) or at least 2 (a killed shard's groups need another)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="rhymerl-chaos-") as tmp:
        result = campaign(args, Path(tmp))
    result.update(command="python -m benchmarks.chaos " + " ".join(sys.argv[1:] if argv is None else argv),
                  commit=git_commit(".", ":(exclude)benchmarks/results"), device=f"CPU: {cpu_name()}",
                  load_average=" ".join(f"{x:.1f}" for x in os.getloadavg()))
    if args.only_fair_share:  # its own file: chaos.json stays the whole campaign's
        print(json.dumps(result, indent=2))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fair_share.json").write_text(json.dumps(result, indent=1) + "\n")
        fair = result["fair_share"]
        (args.out / "fair_share.md").write_text(
            f"# A small step beside a huge one (fair share)\n\n`{result['command']}` at {result['commit']} on "
            f"{result['device']} (load average {os.getloadavg()[0]:.1f} at the end)\n\n| | |\n|---|---|\n"
            + "\n".join(f"| {k} | {v} |" for k, v in fair.items()) + "\n")
        return result
    write(result, args.out)
    return result


if __name__ == "__main__":
    outcome = main()
    sys.exit(0 if not (outcome.get("lost") or outcome.get("duplicated") or outcome.get("hangs")) else 1)
