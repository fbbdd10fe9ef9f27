"""What does batch-invariant mode cost? The engine on the same requests and seeds, with the
mode off and on, side by side in one run.

    python -m benchmarks.batch_invariant_bench                 # CPU (float32)
    python -m benchmarks.batch_invariant_bench --device cuda   # GPU (bf16)

Writes benchmarks/results/batch_invariant.md and .json (``--out``: the folder), this run's
figures only (one file per run and device; a GPU run's go to its device's folder):
  "batch_invariant_mode": {"cpu_slowdown": x, "gpu_slowdown": null, ...} (or the reverse on
      a GPU): the mode's time over the default's on the GRPO-batch workload on this
      device; the other device kind is null with the reason;
  "checks": whether the mode's check passed (a probe's logits bitwise equal alone, in a
      batch, and under 8 and 16 verified drafts; engine_bench's check), in both modes.

Workloads (random weights; T = 1, seeded): a GRPO batch (8 prompts x 4 samples, 32-token
prompts, 64 new tokens), decode at batch 1, and verify-heavy greedy decoding with drafts
that are the true continuation (16 per step). Each is run alternately in both modes,
``--repeats`` times, and the fastest run of each kept. On the CPU the time is the
process's CPU time (one torch thread), which other processes on a shared machine
disturb far less than wall time; on the GPU it is wall time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine_run import ContinuationDrafter
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table, write_results
from services.rollout.engine import CostModel, EngineRequest, LLMEngine, run_to_completion
from services.rollout.loader import init_random_model
from services.rollout.models.config import ModelConfig

RESULTS = Path(__file__).resolve().parent / "results"
GPU_NOT_MEASURED = "needs a CUDA GPU (run `python -m benchmarks.batch_invariant_bench --device cuda`)"


def config(device: str) -> ModelConfig:
    """The CPU: engine_bench's tiny model (4 layers, hidden 256). The GPU: the Qwen2.5-0.5B shape in bf16."""
    if device == "cuda":
        return ModelConfig(
            architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
            rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=True, attention_bias=True,
            qk_norm=False, eos_token_ids=(151643,), bos_token_id=None, dtype="bfloat16")
    return ModelConfig(
        architecture="qwen2", vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=1024, tie_word_embeddings=False, attention_bias=True,
        qk_norm=False, eos_token_ids=(0,), bos_token_id=None, dtype="float32")


def requests(num_prompts: int, samples: int, prompt_len: int, max_tokens: int, vocab: int,
             temperature: float = 1.0) -> list[EngineRequest]:
    out = []
    for p in range(num_prompts):
        prompt = [1 + (7919 * p + 31 * j) % (vocab - 1) for j in range(prompt_len)]
        for k in range(samples):
            out.append(EngineRequest(
                request_id=f"p{p}/{k}", prompt_id=f"p{p}", step_id="bench", sample_index=k, prompt_token_ids=prompt,
                generated_token_ids=[], temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=1000 * p + k,
                max_tokens=max_tokens, max_new_tokens=max_tokens, stop_token_ids=frozenset(), min_tokens=0,
                ignore_eos=True, logprobs=True))
    return out


def run(model, device: str, reqs: list[EngineRequest], batch_invariant: bool, drafter=None) -> tuple[float, dict]:
    engine = LLMEngine(model, device=device, num_kv_blocks=1024, block_size=16, max_num_seqs=64,
                       max_num_batched_tokens=1024, batch_invariant=batch_invariant, drafter=drafter,
                       speculative=drafter is not None, max_draft_len=16, use_cuda_graphs=True,
                       cost_model=CostModel(((1, 1.0), (1024, 1.0))))  # drafts always allowed
    clock = time.perf_counter if device == "cuda" else time.process_time
    _sync(device)
    start = clock()
    outputs = run_to_completion(engine, reqs)
    _sync(device)
    return clock() - start, outputs


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(device: str, repeats: int) -> list[dict]:
    cfg = config(device)
    model = init_random_model(cfg, seed=0).to(device)
    grpo = requests(8, 4, 32, 64, cfg.vocab_size)
    greedy = requests(4, 1, 32, 64, cfg.vocab_size, temperature=0.0)
    # Each mode verifies drafts of its own greedy outputs (all accepted): the row then
    # times verifying 16-token drafts, not how often the other mode's tokens agree.
    continuations = {mode: {rid: out.token_ids for rid, out in run(model, device, greedy, mode)[1].items()}
                     for mode in (False, True)}
    workloads = {
        "GRPO batch (8 prompts x 4 samples, 64 tokens)": (grpo, None),
        "decode, batch 1 (64 tokens)": (grpo[:1], None),
        "verify, 16-token drafts (4 greedy sequences)": (greedy, lambda mode: ContinuationDrafter(continuations[mode])),
    }
    rows = []
    for name, (reqs, drafter) in workloads.items():
        for mode in (False, True):  # warm-up (CUDA graphs, Triton compiles)
            run(model, device, reqs, mode, drafter and drafter(mode))
        times = {False: [], True: []}
        outputs = {}
        for _ in range(repeats):
            for mode in (False, True):  # alternate, so drift on a shared machine hits both
                seconds, outputs[mode] = run(model, device, reqs, mode, drafter and drafter(mode))
                times[mode].append(seconds)
        default_s, invariant_s = min(times[False]), min(times[True])
        tokens = sum(len(o.token_ids) for o in outputs[True].values())
        same = sum(outputs[True][r].token_ids == outputs[False][r].token_ids for r in outputs[True])
        rows.append(dict(workload=name, tokens=tokens, default_s=default_s, invariant_s=invariant_s,
                         slowdown=invariant_s / default_s, same_tokens=f"{same}/{len(outputs[True])}"))
    return rows


def invariance_check(device: str) -> list[dict]:
    """engine_bench's probe check, in both modes, on this benchmark's model."""
    from benchmarks.batch_invariance import batch_invariance

    model = init_random_model(config(device), seed=0).to(device)
    return [dict(mode="batch-invariant", **batch_invariance(model, f"{device} model", batch_invariant=True)),
            dict(mode="default", **batch_invariance(model, f"{device} model", batch_invariant=False))]


def mode_section(device: str, rows: list[dict], meta: dict) -> dict:
    """The "batch_invariant_mode" figures of this run, on this device kind only."""
    kind, other = ("gpu", "cpu") if device == "cuda" else ("cpu", "gpu")
    return {f"{kind}_slowdown": rows[0]["slowdown"], f"{kind}_rows": rows, f"{kind}_device": meta["device"],
            f"{other}_slowdown": None,
            f"{other}_not_measured": GPU_NOT_MEASURED if other == "gpu" else "a GPU run measures the GPU only",
            "headline": rows[0]["workload"], "commit": meta["commit"], "command": meta["command"]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads (the CPU is shared)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return {}
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"{cpu_name()}, {torch.get_num_threads()} torch threads"
    meta = dict(device=device_name, commit=git_commit(), torch=torch.__version__,
                command="python -m benchmarks.batch_invariant_bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    rows = measure(args.device, args.repeats)
    checks = invariance_check(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    section = mode_section(args.device, rows, meta)
    table = markdown_table(rows, [("workload", "workload", "{}"), ("tokens", "tokens", "{}"),
                                  ("default s", "default_s", "{:.2f}"), ("batch-invariant s", "invariant_s", "{:.2f}"),
                                  ("slowdown", "slowdown", "{:.2f}x"), ("same tokens", "same_tokens", "{}")])
    kind = "gpu" if args.device == "cuda" else "cpu"
    text = "\n".join([
        "# Batch-invariant mode: what it costs\n", f"- device: {meta['device']}", f"- commit: {meta['commit']}",
        f"- command: `{meta['command']}`", f"- torch {meta['torch']}\n",
        f"{kind}_slowdown: {section[f'{kind}_slowdown']} (the other device kind: its own run and results folder)\n",
        "Seconds: " + ("wall time" if args.device == "cuda" else "CPU time of the process (one torch thread)")
        + f", fastest of {args.repeats} alternating runs per mode.\n", table, "",
        "Check (a probe's logits alone vs in a batch vs under 8 and 16 verified drafts, bit for bit):", "",
        *[f"- {c['mode']}: {'bitwise equal' if c['invariant'] else 'differs'} (max |diff| "
          f"{max(c['max_abs_diff'].values()):.2e})" for c in checks],
        "", "\"same tokens\": samples whose tokens are identical in both modes (the modes differ in the "
        "last bits of the logits, so a sampled token may flip where two scores nearly tie)."])
    write_results(out, "batch_invariant", dict(**meta, rows=rows, checks=checks, batch_invariant_mode=section),
                  text + "\n")
    print(text)
    return section


if __name__ == "__main__":
    main()
