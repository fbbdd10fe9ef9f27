"""How fast is the engine, with and without speculation, on the same prompts and seeds?

    python -m benchmarks.engine_bench                 # CPU part: a tiny random model
    python -m benchmarks.engine_bench --device cuda   # GPU part: Qwen2.5-0.5B/1.5B shapes, bf16

CPU part: tokens/s and forward steps of Hugging Face transformers `generate` (greedy,
one batch), our engine without speculation, and our engine with the HistoDrafter fed
(a) the exact previous-epoch responses (an oracle history) and (b) responses sampled
with other seeds (a realistic, partly wrong history), on the same prompts; outputs are
checked identical (greedy: HF == engine == engine+spec; sampled: engine == engine+spec).
GPU part: decode step time at batch 1/16/64/256 and verify steps (batch x draft up to
256 tokens) with random bf16 weights: the CUDA-graph forward alone and the whole engine
step (scheduling, sampling, verification included), beside the DESIGN.md H100 floors.
Writes benchmarks/results/engine.md and engine.json with the device, commit and command.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from services.rollout.drafter import HistoDrafter
from services.rollout.engine import CostModel, EngineRequest, LLMEngine
from services.rollout.engine.cost_model import H100_CURVES
from services.rollout.loader import init_random_model, save_model
from services.rollout.models.config import ModelConfig
from services.rollout.models.transformer import CausalLM

RESULTS = Path(__file__).resolve().parent / "results"

TINY = ModelConfig(
    architecture="qwen2", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=1024, tie_word_embeddings=True, attention_bias=True,
    qk_norm=False, eos_token_ids=(0,), bos_token_id=None, dtype="float32")


def qwen_shape(name: str) -> ModelConfig:
    """Qwen2.5-0.5B / 1.5B shapes (random weights, bf16)."""
    hidden, inter, layers, heads, kv = {"0.5B": (896, 4864, 24, 14, 2), "1.5B": (1536, 8960, 28, 12, 2)}[name]
    return ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_scaling=None, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True, qk_norm=False, eos_token_ids=(151643,), bos_token_id=None, dtype="bfloat16")


def request(i: int, prompt: list[int], seed: int, temperature: float, max_tokens: int) -> EngineRequest:
    return EngineRequest(
        request_id=f"r{i}", prompt_id=f"p{i // 4}", step_id="bench", sample_index=i % 4, prompt_token_ids=prompt,
        generated_token_ids=[], temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=seed,
        max_tokens=max_tokens, max_new_tokens=max_tokens, stop_token_ids=frozenset(), min_tokens=0,
        ignore_eos=True, logprobs=True)


def run_engine(engine: LLMEngine, reqs: list[EngineRequest]) -> tuple[dict, float]:
    for r in reqs:
        engine.add_request(r)
    outputs, start = {}, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id] = out
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return outputs, time.perf_counter() - start


# --------------------------------------------------------------------------- CPU part


def cpu_part(num_prompts: int, samples: int, prompt_len: int, max_tokens: int) -> list[dict]:
    torch.manual_seed(0)
    model = init_random_model(TINY, seed=0)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, TINY.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(num_prompts)]

    def reqs(temperature: float, seed_base: int) -> list[EngineRequest]:
        return [request(p * samples + s, prompts[p], seed_base + p * samples + s, temperature, max_tokens)
                for p in range(num_prompts) for s in range(samples)]

    def engine(drafter=None) -> LLMEngine:
        return LLMEngine(model, device="cpu", max_num_seqs=256, max_num_batched_tokens=2048, block_size=16,
                         drafter=drafter, speculative=drafter is not None, max_draft_len=16, cost_model=CostModel())

    def history_drafter(histories: dict[str, list[list[int]]]) -> HistoDrafter:
        drafter = HistoDrafter()
        for prompt_id, responses in histories.items():
            drafter.load_history(prompt_id, responses)
        return drafter

    def by_prompt(outputs: dict) -> dict[str, list[list[int]]]:
        hist: dict[str, list[list[int]]] = {}
        for rid, out in outputs.items():
            hist.setdefault(f"p{int(rid[1:]) // 4}", []).append(out.token_ids)
        return hist

    run_engine(engine(), reqs(0.0, 0)[:4])  # warm-up: first-call costs stay out of the timings
    rows = []
    num_tokens = num_prompts * samples * max_tokens
    # HF transformers generate, greedy, all sequences in one batch (equal-length prompts: no padding).
    hf_tokens, hf_s = hf_generate(model, [r.prompt_token_ids for r in reqs(0.0, 0)], max_tokens)
    rows.append(dict(part="cpu", system="HF transformers generate (greedy)", sampling="greedy", tokens=num_tokens,
                     seconds=hf_s, steps=max_tokens))
    for temperature, label in ((0.0, "greedy"), (1.0, "T=1")):
        plain, plain_s = run_engine(e := engine(), reqs(temperature, 0))
        rows.append(_row("engine, no speculation", label, e, plain, plain_s))
        if temperature == 0.0:
            same = all(plain[f"r{i}"].token_ids == hf_tokens[i] for i in range(len(hf_tokens)))
            rows[-1]["identical_to"] = f"HF generate: {same}"
        # (a) previous epoch = exactly this run's responses (oracle history)
        oracle, oracle_s = run_engine(e := engine(history_drafter(by_prompt(plain))), reqs(temperature, 0))
        rows.append(_row("engine + HistoDrafter, exact history", label, e, oracle, oracle_s))
        rows[-1]["identical_to"] = f"no speculation: {_same(plain, oracle)}"
        # (b) previous epoch sampled with other seeds (greedy: history from T=1 samples)
        other, _ = run_engine(engine(), reqs(1.0, 10_000))
        noisy, noisy_s = run_engine(e := engine(history_drafter(by_prompt(other))), reqs(temperature, 0))
        rows.append(_row("engine + HistoDrafter, other-seed history", label, e, noisy, noisy_s))
        rows[-1]["identical_to"] = f"no speculation: {_same(plain, noisy)}"
    return rows


def _same(a: dict, b: dict) -> bool:
    return all(a[k].token_ids == b[k].token_ids and
               max((abs(x - y) for x, y in zip(a[k].logprobs, b[k].logprobs)), default=0.0) < 1e-4 for k in a)


def _row(system: str, sampling: str, engine: LLMEngine, outputs: dict, seconds: float) -> dict:
    c = engine.metrics.counters
    tokens = sum(len(o.token_ids) for o in outputs.values())
    return dict(part="cpu", system=system, sampling=sampling, tokens=tokens, seconds=seconds, steps=c.num_steps,
                draft_tokens=c.num_draft_tokens, accepted_tokens=c.num_accepted_tokens,
                mean_accepted_per_verify=(c.num_accepted_tokens / c.num_drafts) if c.num_drafts else 0.0)


@torch.inference_mode()
def hf_generate(model: CausalLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        save_model(model, tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens, eos_token_id=None, pad_token_id=0)
    seconds = time.perf_counter() - start
    return out[:, ids.shape[1]:].tolist(), seconds


# --------------------------------------------------------------------------- GPU part


class FixedDrafter:
    """Proposes `draft_len` arbitrary tokens for every request (verify-cost measurement)."""

    def __init__(self, draft_len: int):
        self.draft_len = draft_len

    def start_request(self, *a, **k): ...
    def add_tokens(self, *a, **k): ...
    def record_acceptance(self, *a, **k): ...
    def stop_request(self, *a, **k): ...

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        return [[7] * min(self.draft_len, m) for m in max_lens]


def random_model_cuda(config: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config)
    model = model.to(torch.bfloat16).to_empty(device="cuda")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.normal_(0, 0.02)
            else:
                p.normal_(0, 1 / math.sqrt(p.shape[-1]))
    return model


def gpu_part(context_len: int, num_steps: int) -> list[dict]:
    rows = []
    cases = [(b, 0) for b in (1, 16, 64, 256)] + [(1, 16), (4, 16), (16, 8), (16, 15), (32, 7), (64, 3)]
    for name in ("0.5B", "1.5B"):
        model = random_model_cuda(qwen_shape(name))
        floor = dict(H100_CURVES[name])
        for batch, draft in cases:
            max_tokens = 10 * num_steps
            blocks_per_seq = -(-(context_len + max_tokens + draft + 1) // 16)
            engine = LLMEngine(model, device="cuda", max_num_seqs=batch, max_num_batched_tokens=8192,
                               num_kv_blocks=batch * blocks_per_seq + 1, block_size=16,
                               drafter=FixedDrafter(draft) if draft else None, speculative=bool(draft),
                               max_draft_len=max(draft, 1), cost_model=CostModel(tolerance=100.0))
            gen = torch.Generator().manual_seed(batch)
            for i in range(batch):
                prompt = torch.randint(1, 150000, (context_len,), generator=gen).tolist()
                engine.add_request(request(i, prompt, i, 1.0, max_tokens))
            while any(s.num_uncomputed > 1 for s in engine.seqs.values()) or engine.num_waiting():
                engine.step()  # prefill
            for _ in range(3):
                engine.step()  # capture graphs, warm up
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(num_steps):
                engine.step()
            torch.cuda.synchronize()
            step_ms = (time.perf_counter() - start) / num_steps * 1e3
            forward_ms = _graph_forward_ms(engine, batch, batch * (1 + draft), draft)
            tokens = batch * (1 + draft)
            rows.append(dict(part="gpu", model=name, batch=batch, draft=draft, tokens_per_forward=tokens,
                             forward_ms=forward_ms, step_ms=step_ms,
                             design_ms=CostModel(H100_CURVES[name]).step_ms(tokens),
                             floor_ms={"0.5B": 0.34, "1.5B": 1.06}[name], design_m1_ms=floor[1]))
            print(rows[-1], flush=True)
            del engine
            gc.collect()  # the engine's CUDA graphs hold references back to it
            torch.cuda.empty_cache()
        del model
        gc.collect()
    return rows


def _graph_forward_ms(engine: LLMEngine, batch: int, tokens: int, draft: int) -> float | None:
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    key = graphs.bucket(batch, tokens, 1 + draft)
    if key not in graphs.graphs:
        return None
    replay = graphs.graphs[key]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    start.record()
    for _ in range(20):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20


# --------------------------------------------------------------------------- report


def _git_commit() -> str:
    try:
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True).stdout
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return head.stdout.strip() + (" (uncommitted changes)" if dirty.strip() else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "uncommitted"


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch threads"


def markdown(meta: dict, rows: list[dict]) -> str:
    lines = ["# Engine benchmark\n", f"- device: {meta['device']}", f"- commit: {meta['commit']}",
             f"- command: `{meta['command']}`", f"- torch {meta['torch']}\n"]
    cpu = [r for r in rows if r["part"] == "cpu"]
    if cpu:
        lines += ["## CPU: tiny random model (4 layers, hidden 256), same prompts and seeds\n",
                  "| system | sampling | tokens | s | tokens/s | forward steps | draft tok | accepted | "
                  "accepted/verify | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in cpu:
            lines.append(f"| {r['system']} | {r['sampling']} | {r['tokens']} | {r['seconds']:.2f} | "
                         f"{r['tokens'] / r['seconds']:.0f} | {r['steps']} | {r.get('draft_tokens', '')} | "
                         f"{r.get('accepted_tokens', '')} | {r.get('mean_accepted_per_verify', 0):.2f} | "
                         f"{r.get('identical_to', '')} |")
    gpu = [r for r in rows if r["part"] == "gpu"]
    if gpu:
        lines += ["\n## GPU: decode/verify step, random bf16 weights\n",
                  "| model | batch | draft | tokens/forward | graph forward ms | engine step ms | DESIGN.md ms | "
                  "HBM floor ms |", "|---|---|---|---|---|---|---|---|"]
        for r in gpu:
            fwd = f"{r['forward_ms']:.3f}" if r["forward_ms"] is not None else "n/a"
            lines.append(f"| {r['model']} | {r['batch']} | {r['draft']} | {r['tokens_per_forward']} | {fwd} | "
                         f"{r['step_ms']:.3f} | {r['design_ms']:.2f} | {r['floor_ms']:.2f} |")
    else:
        lines.append("\nGPU part: unmeasured here (run `python -m benchmarks.engine_bench --device cuda`).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--context-len", type=int, default=512, help="GPU part: tokens of context per sequence")
    parser.add_argument("--steps", type=int, default=50, help="GPU part: timed steps per case")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("no CUDA device: nothing to measure")
            return {}
        rows = gpu_part(args.context_len, args.steps)
    else:
        rows = cpu_part(args.prompts, args.samples, args.prompt_len, args.max_tokens)
    meta = dict(device=_device_name(args.device), commit=_git_commit(), torch=torch.__version__,
                command="python -m benchmarks.engine_bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.device == "cpu" else "_gpu"
    text = markdown(meta, rows)
    (out / f"engine{suffix}.md").write_text(text)
    (out / f"engine{suffix}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print(text)
    return dict(meta=meta, rows=rows)


if __name__ == "__main__":
    main()
