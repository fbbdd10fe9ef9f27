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
import dataclasses
import gc
import json
import math
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.provenance import git_commit
from services.rollout.drafter import HistoDrafter
from services.rollout.engine import CostModel, EngineRequest, LLMEngine
from services.common.cost_curve import H100_CURVES
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
                         drafter=drafter, speculative=drafter is not None, max_draft_len=16)

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


def _row(system: str, sampling: str, engine: LLMEngine, outputs: dict, seconds: float, part: str = "cpu",
         setting: str = "") -> dict:
    c = engine.metrics.counters
    tokens = sum(len(o.token_ids) for o in outputs.values())
    return dict(part=part, system=system, sampling=sampling, setting=setting, tokens=tokens, seconds=seconds,
                steps=c.num_steps, draft_tokens=c.num_draft_tokens, accepted_tokens=c.num_accepted_tokens,
                mean_accepted_per_verify=(c.num_accepted_tokens / c.num_drafts) if c.num_drafts else 0.0)


@torch.inference_mode()
def hf_generate(model: CausalLM | str, prompts: list[list[int]], max_tokens: int, device: str = "cpu",
                eos: tuple[int, ...] | None = None) -> tuple[list[list[int]], float]:
    """Greedy HF transformers `generate` of all prompts in one batch (left padding).
    eos None: exactly max_tokens each; else each response ends at its first EOS (kept)."""
    from transformers import AutoModelForCausalLM

    if isinstance(model, CausalLM):
        with tempfile.TemporaryDirectory() as tmp:
            save_model(model, tmp)
            hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    hf = hf.to(device)
    pad = eos[0] if eos else 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    _sync(device)
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                      min_new_tokens=None if eos else max_tokens, eos_token_id=list(eos) if eos else None,
                      pad_token_id=pad)
    _sync(device)
    seconds = time.perf_counter() - start
    responses = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if eos and t in eos), len(row))
        responses.append(row[:end])
    return responses, seconds


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


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
            floor_ms = _weight_chain_ms(model, batch) if draft == 0 else None
            rows.append(dict(part="gpu", model=name, batch=batch, draft=draft, tokens_per_forward=tokens,
                             forward_ms=forward_ms, step_ms=step_ms, measured_floor_ms=floor_ms,
                             design_ms=CostModel(H100_CURVES[name]).step_ms(tokens),
                             floor_ms={"0.5B": 0.34, "1.5B": 1.06}[name], design_m1_ms=floor[1]))
            print(rows[-1], flush=True)
            del engine
            gc.collect()  # the engine's CUDA graphs hold references back to it
            torch.cuda.empty_cache()
        del model
        gc.collect()
    return rows


@torch.inference_mode()
def _weight_chain_ms(model: CausalLM, batch: int, repeats: int = 20) -> float:
    """The measured floor of a decode step at this batch: every weight matrix of the model
    (all layers' projections and the LM head) multiplied by a [batch, in_features] input,
    one after another, captured as one CUDA graph; the replay time in ms."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], device=w.device, dtype=w.dtype) for w in weights}
    outputs = [torch.empty(batch, w.shape[0], device=w.device, dtype=w.dtype) for w in weights]

    def chain() -> None:
        for w, y in zip(weights, outputs):
            torch.matmul(inputs[w.shape[1]], w.t(), out=y)

    if not torch.device(weights[0].device).type == "cuda":  # only to check shapes off the GPU
        start = time.perf_counter()
        chain()
        return (time.perf_counter() - start) * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()  # warm-up (cuBLAS handles, workspaces) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


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



# --------------------------------------------------------------------------- trained policy: GRPO batch, batch 1

TRACES = Path(__file__).resolve().parent / "data" / "tiny_grpo_cpu.npz"


def trained_policy(model_dir: str, device: str) -> CausalLM:
    """The RL-loop issue's tiny SFT policy (trained on first use, ~3 min on 2 cores, as `make run` does)."""
    from services.local import ensure_model
    from services.rollout.loader import load_model

    ensure_model(model_dir)
    return load_model(model_dir, device, torch.float32)


def grpo_requests(records, num_prompts: int, samples: int, temperature: float, max_tokens: int,
                  eos: tuple[int, ...]) -> list[EngineRequest]:
    """num_prompts x samples requests on the last recorded epoch's prompts (one seed per sample)."""
    last = max(r.epoch for r in records)
    prompts = {}
    for r in records:
        if r.epoch == last and r.prompt_id not in prompts:
            prompts[r.prompt_id] = [int(t) for t in r.prompt_token_ids]
    reqs = []
    for p, (prompt_id, prompt) in enumerate(list(prompts.items())[:num_prompts]):
        for s in range(samples):
            i = p * samples + s
            reqs.append(EngineRequest(
                request_id=f"r{i}", prompt_id=prompt_id, step_id="grpo", sample_index=s, prompt_token_ids=prompt,
                generated_token_ids=[], temperature=temperature, top_p=1.0, top_k=0, min_p=0.0, seed=1000 + i,
                max_tokens=max_tokens, max_new_tokens=max_tokens, stop_token_ids=frozenset(eos), min_tokens=0,
                ignore_eos=False, logprobs=True))
    return reqs


def grpo_part(model_dir: str, device: str, num_prompts: int, samples: int, max_tokens: int) -> tuple[list[dict], dict]:
    """One GRPO-sized step of the trained policy on the recorded prompts: HF generate vs our
    engine (greedy, outputs compared), and our engine without vs with history drafts
    (T=1, same seeds; the history is the recorded earlier epochs' responses)."""
    from services.common.traces import read_traces

    model = trained_policy(model_dir, device)
    eos = tuple(model.config.eos_token_ids)
    records = read_traces(TRACES)
    last = max(r.epoch for r in records)
    history: dict[str, list[list[int]]] = {}
    for r in records:
        if r.epoch < last:
            history.setdefault(r.prompt_id, []).append([int(t) for t in r.token_ids])

    def engine(drafter=None) -> LLMEngine:
        return LLMEngine(model, device=device, max_num_seqs=256, max_num_batched_tokens=2048, block_size=16,
                         num_kv_blocks=4096, drafter=drafter, speculative=drafter is not None, max_draft_len=16)

    def drafter() -> HistoDrafter:
        d = HistoDrafter()
        for prompt_id, responses in history.items():
            d.load_history(prompt_id, responses)
        return d

    setting = f"{num_prompts} prompts x {samples} samples, max {max_tokens} tokens, stop at EOS"
    run_engine(engine(), grpo_requests(records, 2, 2, 1.0, 16, eos))  # warm-up
    rows = []
    greedy = grpo_requests(records, num_prompts, samples, 0.0, max_tokens, eos)
    hf_tokens, hf_s = hf_generate(model_dir, [r.prompt_token_ids for r in greedy], max_tokens, device, eos)
    rows.append(dict(part="grpo", system="HF transformers generate", sampling="greedy", setting=setting,
                     tokens=sum(len(t) for t in hf_tokens), seconds=hf_s, steps=max(len(t) for t in hf_tokens)))
    plain_g, plain_g_s = run_engine(e := engine(), greedy)
    rows.append(_row("engine, no speculation", "greedy", e, plain_g, plain_g_s, part="grpo", setting=setting))
    same_hf = sum(plain_g[r.request_id].token_ids == hf_tokens[i] for i, r in enumerate(greedy))
    rows[-1]["identical_to"] = f"HF generate: {same_hf}/{len(greedy)}"
    sampled = grpo_requests(records, num_prompts, samples, 1.0, max_tokens, eos)
    plain, plain_s = run_engine(e := engine(), sampled)
    rows.append(_row("engine, no speculation", "T=1", e, plain, plain_s, part="grpo", setting=setting))
    spec, spec_s = run_engine(e := engine(drafter()), sampled)
    rows.append(_row("engine + HistoDrafter, recorded earlier epochs", "T=1", e, spec, spec_s, part="grpo",
                     setting=setting))
    identical = [k for k in plain if plain[k].token_ids == spec[k].token_ids]
    divergences = [next(i for i, (a, b) in enumerate(zip(plain[k].token_ids + [-1], spec[k].token_ids + [-2]))
                        if a != b) for k in plain if k not in identical]
    rows[-1]["identical_to"] = f"no speculation: {len(identical)}/{len(plain)}"
    hf_tps = rows[0]["tokens"] / hf_s
    summary = dict(
        speedup_vs_hf_grpo=(rows[1]["tokens"] / plain_g_s) / hf_tps,
        spec_speedup_grpo=plain_s / spec_s,
        identical_share=len(identical) / len(plain),
        first_divergence_positions=sorted(divergences),
        identical_to_hf_greedy_share=same_hf / len(greedy),
        grpo_setting=setting,
    )
    # Batch 1: one prompt, greedy, a fixed number of tokens.
    one = grpo_requests(records, 1, 1, 0.0, max_tokens, eos)
    one = [dataclasses.replace(one[0], ignore_eos=True, stop_token_ids=frozenset())]
    hf1, hf1_s = hf_generate(model_dir, [one[0].prompt_token_ids], max_tokens, device, None)
    rows.append(dict(part="b1", system="HF transformers generate", sampling="greedy", setting="batch 1",
                     tokens=len(hf1[0]), seconds=hf1_s, steps=len(hf1[0])))
    ours1, ours1_s = run_engine(e := engine(), one)
    rows.append(_row("engine, no speculation", "greedy", e, ours1, ours1_s, part="b1", setting="batch 1"))
    rows[-1]["identical_to"] = f"HF generate: {ours1['r0'].token_ids == hf1[0]}"
    summary["speedup_vs_hf_b1"] = (len(ours1["r0"].token_ids) / ours1_s) / (len(hf1[0]) / hf1_s)
    return rows, summary


# --------------------------------------------------------------------------- batch invariance


@torch.inference_mode()
def batch_invariance(model: CausalLM, label: str, block_size: int = 16, batch_invariant: bool = False) -> dict:
    """Does a sequence's logits row change when other sequences join the batch, or when
    more tokens are verified behind it? The probe sequence's next-token logits are
    computed (a) alone as a decode, (b) in a batch of decodes, (c) as the first row of an
    8-token verify, (d) that verify in a batch of ragged verifies; compared bit for bit.
    Runs the engine's own path (model + paged attention backend, eager)."""
    from services.rollout.engine.attention import (
        AttentionMetadata,
        KVCache,
        PagedAttention,
    )

    cfg = model.config
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(3)
    lens = [37, 70, 5, 120]  # probe first, then the others
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
    draft = torch.randint(1, cfg.vocab_size, (16,), generator=gen).tolist()
    width = -(-(max(lens) + len(draft)) // block_size)
    cache = KVCache(cfg.num_hidden_layers, len(lens) * width, block_size, cfg.num_key_value_heads, cfg.head_dim,
                    dtype, device)
    attn = PagedAttention(cache, cfg.head_dim ** -0.5, batch_invariant=batch_invariant)
    tables = [list(range(s * width, (s + 1) * width)) for s in range(len(lens))]

    def forward(items: list[tuple[int, list[int], int]]) -> list[torch.Tensor]:
        """items: (sequence, tokens fed, position of the first) -> each item's logits rows."""
        ids, pos, slots, seq_lens, cu = [], [], [], [], [0]
        for s, tokens, start in items:
            ids += tokens
            pos += range(start, start + len(tokens))
            slots += [tables[s][p // block_size] * block_size + p % block_size for p in range(start, start + len(tokens))]
            seq_lens.append(start + len(tokens))
            cu.append(cu[-1] + len(tokens))
        t = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
        attn.metadata = AttentionMetadata(t(slots, torch.int64), t([tables[s] for s, _, _ in items], torch.int32),
                                          t(seq_lens, torch.int32), t(cu, torch.int32),
                                          max(b - a for a, b in zip(cu, cu[1:])))
        hidden = model.forward(t(ids, torch.int64), t(pos, torch.int64), attn)
        logits = model.compute_logits(hidden, batch_invariant).float()
        return [logits[a:b] for a, b in zip(cu, cu[1:])]

    for s, p in enumerate(prompts):
        forward([(s, p[:-1], 0)])  # prefill all but the last prompt token
    last = [(s, [p[-1]], len(p) - 1) for s, p in enumerate(prompts)]
    alone = forward([last[0]])[0][0]
    cases = {
        "decode in a batch of 4": forward([last[1], last[0], last[2], last[3]])[1][0],
        "verify 8 drafts, alone": forward([(0, [prompts[0][-1]] + draft[:8], lens[0] - 1)])[0][0],
        "verify 16 drafts in a ragged batch": forward([
            (1, [prompts[1][-1]] + draft[:3], lens[1] - 1), (0, [prompts[0][-1]] + draft, lens[0] - 1),
            last[2], (3, [prompts[3][-1]] + draft[:5], lens[3] - 1)])[1][0],
    }
    diffs = {name: float((row - alone).abs().max()) for name, row in cases.items()}
    return dict(model=label, invariant=all(torch.equal(row, alone) for row in cases.values()), max_abs_diff=diffs)


# --------------------------------------------------------------------------- report


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch threads"


GPU_ONLY = {
    "decode_ms": "decode step time at batch 1/16/64/256 for the Qwen2.5-0.5B/1.5B shapes in bf16: needs a CUDA GPU",
    "floor_ms": "the CUDA-graphed chain of the same weight matrices: needs a CUDA GPU",
    "verify_over_decode_16x8": "verify 16 x 8 over decode 16, Qwen2.5 shapes in bf16: needs a CUDA GPU",
}


def summarize(device: str, rows: list[dict], grpo: dict, invariance: list[dict]) -> dict:
    """The issue's results format: the headline figures, null where this run cannot measure them."""
    out = dict(decode_ms=None, floor_ms=None, verify_over_decode_16x8=None)
    gpu = [r for r in rows if r["part"] == "gpu"]
    if gpu:
        key = lambda r: f"{r['model'].lower()}_b{r['batch']}"  # noqa: E731
        out["decode_ms"] = {key(r): r["step_ms"] for r in gpu if r["draft"] == 0}
        out["decode_forward_ms"] = {key(r): r["forward_ms"] for r in gpu if r["draft"] == 0}
        out["floor_ms"] = {key(r): r["measured_floor_ms"] for r in gpu if r["draft"] == 0}
        step = {(r["model"], r["batch"], r["draft"]): r["step_ms"] for r in gpu}
        by_model = {m.lower(): step[(m, 16, 8)] / step[(m, 16, 0)] for m in ("0.5B", "1.5B")
                    if (m, 16, 8) in step and (m, 16, 0) in step}
        out["verify_over_decode_16x8"] = by_model.get("0.5b")
        out["verify_over_decode_16x8_by_model"] = by_model
    out.update({k: grpo.get(k) for k in ("speedup_vs_hf_b1", "speedup_vs_hf_grpo", "spec_speedup_grpo",
                                          "identical_share")})
    out["batch_invariant"] = all(c["invariant"] for c in invariance) if invariance else None
    out["batch_invariance"] = invariance
    out.update({k: v for k, v in grpo.items() if k not in out})
    out["not_measured"] = [f"{k}: {why} (this run: {device})" for k, why in GPU_ONLY.items() if out[k] is None]
    return out


# The results format; a GPU run fills every one (per shape where it is a dict).
HEADLINE = ("decode_ms", "floor_ms", "verify_over_decode_16x8", "speedup_vs_hf_b1", "speedup_vs_hf_grpo",
            "spec_speedup_grpo", "identical_share", "batch_invariant")


def markdown(meta: dict, summary: dict, rows: list[dict]) -> str:
    lines = ["# Engine benchmark\n", f"- device: {meta['device']}", f"- commit: {meta['commit']}",
             f"- command: `{meta['command']}`", f"- torch {meta['torch']}\n", "## Headline figures\n",
             "| figure | value |", "|---|---|"]
    for k in HEADLINE:
        v = summary.get(k)
        if isinstance(v, dict):
            v = ", ".join(f"{a}: {b:.3f}" if isinstance(b, float) else f"{a}: {b}" for a, b in v.items())
        elif isinstance(v, float):
            v = f"{v:.3f}"
        lines.append(f"| {k} | {'not measured' if v is None else v} |")
    if summary.get("not_measured"):
        lines += ["\nNot measured in this run:\n"] + [f"- {x}" for x in summary["not_measured"]]
    if summary.get("grpo_setting"):
        lines.append(f"\nGRPO batch: {summary['grpo_setting']}; first divergences of non-identical samples at "
                     f"generated positions {summary.get('first_divergence_positions') or 'none'}.")
    for c in summary.get("batch_invariance", []):
        diffs = ", ".join(f"{k}: {v:.2e}" for k, v in c["max_abs_diff"].items())
        lines.append(f"\nBatch invariance, {c['model']}: {c['invariant']} (max |logit diff| vs the probe "
                     f"decoded alone: {diffs})")
    sections = [("b1", "Trained tiny policy, batch 1 (greedy, fixed length)"),
                ("grpo", "Trained tiny policy, one GRPO batch on the recorded prompts"),
                ("cpu", "Tiny random model (4 layers, hidden 256), same prompts and seeds")]
    for part, title in sections:
        sel = [r for r in rows if r["part"] == part]
        if not sel:
            continue
        lines += [f"\n## {title}\n",
                  "| system | sampling | tokens | s | tokens/s | forward steps | draft tok | accepted | "
                  "accepted/verify | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sel:
            lines.append(f"| {r['system']} | {r['sampling']} | {r['tokens']} | {r['seconds']:.2f} | "
                         f"{r['tokens'] / r['seconds']:.0f} | {r['steps']} | {r.get('draft_tokens', '')} | "
                         f"{r.get('accepted_tokens', '')} | {r.get('mean_accepted_per_verify', 0):.2f} | "
                         f"{r.get('identical_to', '')} |")
    gpu = [r for r in rows if r["part"] == "gpu"]
    if gpu:
        lines += ["\n## GPU: decode/verify step, random bf16 weights\n",
                  "| model | batch | draft | tokens/forward | graph forward ms | engine step ms | measured floor ms | "
                  "H100 table ms | HBM floor ms |", "|---|---|---|---|---|---|---|---|---|"]
        for r in gpu:
            fwd = f"{r['forward_ms']:.3f}" if r["forward_ms"] is not None else "n/a"
            floor = f"{r['measured_floor_ms']:.3f}" if r["measured_floor_ms"] is not None else ""
            lines.append(f"| {r['model']} | {r['batch']} | {r['draft']} | {r['tokens_per_forward']} | {fwd} | "
                         f"{r['step_ms']:.3f} | {floor} | {r['design_ms']:.2f} | {r['floor_ms']:.2f} |")
    else:
        lines.append("\nGPU part: unmeasured here (run `make bench-gpu`, i.e. "
                     "`python -m benchmarks.engine_bench --device cuda`).")
    return "\n".join(lines) + "\n"


def _batch_invariant_mode_keys(path: Path) -> dict:
    """The batch-invariant mode's figures, written by benchmarks/batch_invariant_bench.py:
    kept across re-runs of this benchmark."""
    keys = ("batch_invariant_mode", "batch_invariant", "batch_invariant_check")
    old = json.loads(path.read_text()) if path.exists() else {}
    return {k: old[k] for k in keys if k in old and "batch_invariant_mode" in old}


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
    meta = dict(device=_device_name(args.device), commit=git_commit(), torch=torch.__version__,
                command="python -m benchmarks.engine_bench " + " ".join(argv if argv is not None else sys.argv[1:]))
    summary = summarize(args.device, rows, grpo, invariance)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(meta, summary, rows)
    (out / "engine.md").write_text(text)
    result = dict(**meta, **summary, rows=rows)
    result.update(_batch_invariant_mode_keys(out / "engine.json"))
    (out / "engine.json").write_text(json.dumps(result, indent=2) + "\n")
    print(text)
    unmeasured = [k for k in HEADLINE if result.get(k) is None or result[k] == {} or (
        isinstance(result[k], dict) and None in result[k].values())]
    if args.device == "cuda" and unmeasured:
        raise SystemExit(f"engine_bench --device cuda: no figure for {', '.join(unmeasured)}")
    return result


if __name__ == "__main__":
    main()
