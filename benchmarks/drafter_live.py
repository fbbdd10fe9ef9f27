"""How much of the replay's draft acceptance survives on the live system, with 1, 2 and 4
workers (each worker's global index sees only its own samples and the history stream).

For each worker count: start the whole system (LocalCluster: history, scheduler, N CPU
workers, as `make run`), run the example GRPO trainer for a few steps while recording
its rollouts, read the workers' speculative counters, then replay the very trace just
recorded in one process (`benchmarks.drafter_replay`, the drafter seeing every prompt).
Reported per worker count: accepted and drafted tokens per verify and the acceptance
rate, live and replayed, and live / replay.

The live workers price drafts on the engine's cost model measured on this CPU, the
replay on the H100 prior, so drafted/verify differs by design; the acceptance rate
(accepted / drafted) is the comparable figure.

    python -m benchmarks.drafter_live [--workers 1 2 4] [--steps 4] [--prompts 16]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks import drafter_replay as R
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table, write_results
from benchmarks.tiny_llm.checkpoint import ensure_model
from benchmarks.tiny_llm.examples import load_example
from services.local import LocalCluster
from services.rollout.drafter import DrafterConfig, HistoDrafter
from services.rollout.engine.cost_model import CostModel


class _CountingClient:
    """The trainer's client, summing every returned sample's speculative counters."""

    def __init__(self, client) -> None:
        self.client = client
        self.verify = self.drafted = self.accepted = 0

    def rollout(self, *args, **kwargs):
        result = self.client.rollout(*args, **kwargs)
        for s in result.samples:
            self.verify += s.num_verify_steps
            self.drafted += s.num_draft_tokens
            self.accepted += s.num_accepted_tokens
        return result

    def __getattr__(self, name):
        return getattr(self.client, name)


def live_run(num_workers: int, args, trace_path: Path) -> dict:
    from rhymerl import RolloutClient

    with LocalCluster(model_dir=args.model_dir, num_workers=num_workers,
                      log_dir=trace_path.parent / f"logs-{num_workers}") as cluster:
        trainer = load_example("grpo_trainer")
        with RolloutClient(cluster.scheduler_address, timeout_s=1800) as plain:
            client = _CountingClient(plain)
            started = time.time()
            trainer.run(client, args.model_dir, steps=args.steps, num_prompts=args.prompts, n=args.n,
                        max_tokens=args.max_tokens, record=str(trace_path), partial_credit=0.5,
                        log=lambda line: print(f"  [{num_workers} workers] {line}", flush=True))
            wall = time.time() - started
    verify, drafted, accepted = client.verify, client.drafted, client.accepted
    return {"accepted_per_verify": accepted / max(1, verify), "draft_per_verify": drafted / max(1, verify),
            "acceptance_rate": accepted / max(1, drafted), "wall_s": wall}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=384)
    parser.add_argument("--model-dir", default="models/tiny")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    ensure_model(args.model_dir)
    load_before = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory(prefix="rhymerl-live-") as tmp:
        for num_workers in args.workers:
            path = Path(tmp) / f"live-{num_workers}.npz"
            live = live_run(num_workers, args, path)
            traces = R.load_traces(str(path))
            replayed = R.replay(traces, lambda: HistoDrafter(DrafterConfig(cost_model=CostModel())),
                                R.stop_token(traces), "replay")
            rows.append({
                "workers": num_workers,
                "live_accepted_per_verify": live["accepted_per_verify"],
                "live_draft_per_verify": live["draft_per_verify"],
                "live_acceptance_rate": live["acceptance_rate"],
                "replay_accepted_per_verify": replayed["mean_accepted_drafts_per_step"],
                "replay_draft_per_verify": replayed["draft_tokens_per_step"],
                "replay_acceptance_rate": replayed["acceptance_rate"],
                "rate_survives": live["acceptance_rate"] / max(1e-12, replayed["acceptance_rate"]),
                "live_wall_s": live["wall_s"],
            })
            print(rows[-1], flush=True)
    columns = [("workers", "workers", "{}"), ("live acc/verify", "live_accepted_per_verify", "{:.3f}"),
               ("live draft/verify", "live_draft_per_verify", "{:.2f}"),
               ("live acc rate", "live_acceptance_rate", "{:.3f}"),
               ("replay acc/verify", "replay_accepted_per_verify", "{:.3f}"),
               ("replay draft/verify", "replay_draft_per_verify", "{:.2f}"),
               ("replay acc rate", "replay_acceptance_rate", "{:.3f}"),
               ("rate live/replay", "rate_survives", "{:.2f}"), ("live wall s", "live_wall_s", "{:.0f}")]
    text = markdown_table(rows, columns)
    command = "python -m benchmarks.drafter_live " + " ".join(argv or [])
    summary = {"rows": rows, "cpu": cpu_name(), "device": "CPU workers (LocalCluster)",
               "git_commit": git_commit("services", "benchmarks/drafter_live.py"), "command": command.strip(),
               "load_average_1min": [load_before, os.getloadavg()[0]],
               "settings": {"steps": args.steps, "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens}}
    print(text)
    write_results(args.out, "drafter_live", summary,
        f"# Drafter, live vs replay\n\nCommand: `{summary['command']}`, commit {summary['git_commit']}, "
        f"CPU {summary['cpu']}, load {load_before:.1f} -> {summary['load_average_1min'][1]:.1f} on "
        f"{os.cpu_count()} shared cores. {args.steps} GRPO steps x {args.prompts} prompts x {args.n} samples, "
        f"max_tokens {args.max_tokens}, the tiny policy.\n\n{__doc__.split(chr(10) + chr(10), 1)[1]}\n{text}\n")
    return summary


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
