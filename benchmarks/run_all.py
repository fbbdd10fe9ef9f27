"""Runs every benchmark for one device kind: `make bench` (cpu) or `make bench-gpu` (cuda)."""

from __future__ import annotations

import argparse
import subprocess
import sys

CPU = [
    ["benchmarks.trace_similarity", "benchmarks/data/tiny_grpo_service.npz", "benchmarks/data/tiny_grpo_cpu.npz"],
    ["benchmarks.drafter_bench", "--traces", "benchmarks/data/tiny_grpo_service.npz"],
    ["benchmarks.scheduler_bench", "--live", "--extra"],
    ["benchmarks.prediction_limit"],
    ["benchmarks.engine_bench", "--device", "cpu"],
    # The long fault campaign (make test runs a short one): separate processes, kill -9s.
    ["benchmarks.chaos", "--seed", "1", "--faults", "200", "--steps", "50"],
]
GPU = [
    # The issue-3 policy on one GPU (target: under 10 minutes); train_log.json has the time.
    ["benchmarks.policy.train_sft", "--preset", "small", "--out", "models/small", "--device", "cuda"],
    ["benchmarks.kernels_bench"],
    # Live placement with several workers sharing the GPU (written to its own file).
    ["benchmarks.scheduler_bench", "--workers", "8", "--live", "--live-device", "cuda", "--live-workers", "8",
     "--out", "benchmarks/results/scheduler_gpu_live"],
    ["benchmarks.engine_bench", "--device", "cuda"],
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    failed = []
    for module in CPU if args.device == "cpu" else GPU:
        print(f"\n=== {' '.join(module)} ===", flush=True)
        if subprocess.run([sys.executable, "-m", *module], check=False).returncode != 0:
            failed.append(module[0])
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
