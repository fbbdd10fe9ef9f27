"""Runs every benchmark for one device kind: `make bench` (cpu) or `make bench-gpu` (cuda)."""

from __future__ import annotations

import argparse
import subprocess
import sys

CPU = [
    ["benchmarks.trace_similarity", "benchmarks/data/tiny_grpo_service.npz", "benchmarks/data/tiny_grpo_cpu.npz",
     "benchmarks/data/tiny_grpo_service_t07.npz", "benchmarks/data/smollm2_grpo.npz"],
    # vLLM's suffix method, built from the arctic-inference sdist into ~/.cache (not committed).
    ["benchmarks.peers.build_suffix_decoding"],
    ["benchmarks.drafter_bench", "--traces", "benchmarks/data/tiny_grpo_service.npz",
     "benchmarks/data/tiny_grpo_service_t07.npz", "benchmarks/data/smollm2_grpo.npz"],
    ["benchmarks.drafter_host"],  # issue 24's targets for the compiled core, every round (seconds)
    ["benchmarks.drafter_live"],
    ["benchmarks.scheduler_bench", "--live", "--extra"],
    ["benchmarks.prediction_limit"],
    ["benchmarks.engine_bench", "--device", "cpu"],
    ["benchmarks.batch_invariant_bench", "--device", "cpu"],
    ["benchmarks.e2e_bench"],
    ["benchmarks.control_plane"],  # the scheduler process under a fake fleet (a few minutes)
    ["benchmarks.control_plane_shards"],  # shards behind the router: control_plane.json's "shards" (after it)
    ["benchmarks.vllm_bench"],  # vLLM's engine with each proposer beside ours (make install-vllm)
    # The long fault campaign (make test runs a short one): separate processes, kill -9s.
    ["benchmarks.chaos", "--seed", "1", "--faults", "200", "--steps", "50"],
    ["benchmarks.chaos", "--shards", "2", "--seed", "1", "--faults", "40", "--steps", "20"],  # sharded
]
# `make bench-gpu` (deploy/gpu/launch.py bench): every GPU figure of engine.json first, then
# the kernels; one device command (under 10 minutes). The e2e benchmark and the `small`
# policy's training are campaign steps of their own (docs/gpu.md).
GPU = [
    ["benchmarks.engine_bench", "--device", "cuda"],
    ["benchmarks.batch_invariant_bench", "--device", "cuda"],
    ["benchmarks.kernels_bench", "--quick"],
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--out", help="GPU: the results folder (default: each benchmark's own)")
    args = parser.parse_args()
    failed = []
    for module in CPU if args.device == "cpu" else GPU:
        if args.out and args.device == "cuda":
            module = [*module, "--out", args.out]
        print(f"\n=== {' '.join(module)} ===", flush=True)
        if subprocess.run([sys.executable, "-m", *module], check=False).returncode != 0:
            failed.append(module[0])
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
