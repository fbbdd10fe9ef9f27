"""How fast is the engine, with and without speculation, on the same prompts and seeds?

    python -m benchmarks.engine_bench                 # CPU: everything but the GPU-only figures
    python -m benchmarks.engine_bench --device cuda   # GPU (make bench-gpu): all figures

Both runs write benchmarks/results/engine.md and engine.json in the issue's results format
(device, decode_ms, floor_ms, verify_over_decode_16x8, speedup_vs_hf_b1, speedup_vs_hf_grpo,
spec_speedup_grpo, identical_share, batch_invariant, command); a figure the run cannot
measure is null and named in "not_measured".

- Trained policy (both devices): the tiny SFT policy (models/tiny, trained on first use as
  `make run` does) on the recorded prompts of benchmarks/data/tiny_grpo_cpu.npz. HF
  transformers `generate` vs our engine, greedy, at batch 1 and on one GRPO batch (outputs
  compared); our engine without vs with the HistoDrafter fed the recorded earlier epochs'
  responses, T=1, same seeds (identical_share: samples identical token for token).
- Batch invariance (both): a probe sequence's logits alone vs in a batch vs under verify.
- CPU: also a tiny random model, engine vs HF and with oracle / other-seed histories.
- GPU: decode step time at batch 1/16/64/256 and verify steps (batch x draft up to 256
  tokens) with random bf16 weights for the Qwen2.5-0.5B/1.5B shapes: the CUDA-graph forward
  alone and the whole engine step, beside the floor measured in the same run (a CUDA-graphed
  chain of the same weight matrices) and the H100 table of docs/cost-model.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from benchmarks.batch_invariance import batch_invariance
from benchmarks.engine_gpu_steps import gpu_part, qwen_shape, random_model_cuda
from benchmarks.engine_grpo import grpo_part, trained_policy
from benchmarks.engine_random_model import TINY, cpu_part
from benchmarks.engine_report import HEADLINE, device_name, markdown, summarize
from benchmarks.provenance import git_commit
from benchmarks.report import write_results
from services.rollout.loader import init_random_model

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads (the CPU is shared)")
    parser.add_argument("--prompts", type=int, default=8, help="random-model part (CPU)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model-dir", default="models/tiny", help="the trained tiny policy (trained if missing)")
    parser.add_argument("--grpo-prompts", type=int, default=32, help="recorded prompts in the GRPO batch")
    parser.add_argument("--grpo-samples", type=int, default=4, help="samples per prompt in the GRPO batch")
    parser.add_argument("--grpo-max-tokens", type=int, default=512)
    parser.add_argument("--context-len", type=int, default=512, help="GPU part: tokens of context per sequence")
    parser.add_argument("--steps", type=int, default=50, help="GPU part: timed steps per case")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("engine_bench --device cuda: no CUDA device (torch.cuda.is_available() is False); "
                         "nothing measured")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    rows: list[dict] = []
    invariance = []
    if args.device == "cuda":
        rows += gpu_part(args.context_len, args.steps)
        invariance.append(batch_invariance(random_model_cuda(qwen_shape("0.5B")), "Qwen2.5-0.5B shape, bf16"))
    else:
        rows += cpu_part(args.prompts, args.samples, args.prompt_len, args.max_tokens)
        invariance.append(batch_invariance(init_random_model(TINY, seed=0), "tiny random model, float32"))
    grpo_rows, grpo = grpo_part(args.model_dir, args.device, args.grpo_prompts, args.grpo_samples,
                                args.grpo_max_tokens)
    rows += grpo_rows
    invariance.append(batch_invariance(trained_policy(args.model_dir, args.device), "trained tiny policy, float32"))
    meta = dict(device=device_name(args.device), commit=git_commit(), torch=torch.__version__,
                command="python -m benchmarks.engine_bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    summary = summarize(args.device, rows, grpo, invariance)
    out = Path(args.out)
    text = markdown(meta, summary, rows)
    result = dict(**meta, **summary, rows=rows)
    write_results(out, "engine", result, text)
    print(text)
    unmeasured = [k for k in HEADLINE if result.get(k) is None or result[k] == {} or (
        isinstance(result[k], dict) and None in result[k].values())]
    if args.device == "cuda" and unmeasured:
        raise SystemExit(f"engine_bench --device cuda: no figure for {', '.join(unmeasured)}")
    return result


if __name__ == "__main__":
    main()
