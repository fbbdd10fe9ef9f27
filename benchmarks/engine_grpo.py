"""engine_bench's trained-policy part: one GRPO batch of the tiny SFT policy on the recorded
prompts (HF generate vs our engine, greedy; our engine without vs with history drafts,
T=1, same seeds) and batch 1."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from benchmarks.engine_run import result_row, run_engine
from benchmarks.hf_generate import hf_generate
from services.rollout.drafter import HistoDrafter
from services.rollout.engine import EngineRequest, LLMEngine
from services.rollout.models.transformer import CausalLM

TRACES = Path(__file__).resolve().parent / "data" / "tiny_grpo_cpu.npz"


def trained_policy(model_dir: str, device: str) -> CausalLM:
    """The RL-loop issue's tiny SFT policy (trained on first use, ~3 min on 2 cores, as `make run` does)."""
    from benchmarks.tiny_llm.checkpoint import ensure_model
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
    # Warm-up: each timed configuration once, on the whole batch for 64 tokens, so the
    # Triton kernels each one uses (greedy, sampled, verify) are compiled before timing,
    # as they are in a worker that has served a step.
    for temperature, make_drafter in ((0.0, None), (1.0, None), (1.0, drafter)):
        warm = grpo_requests(records, num_prompts, samples, temperature, min(64, max_tokens), eos)
        run_engine(engine(make_drafter() if make_drafter else None), warm)
    rows = []
    greedy = grpo_requests(records, num_prompts, samples, 0.0, max_tokens, eos)
    hf_tokens, hf_s = hf_generate(model_dir, [r.prompt_token_ids for r in greedy], max_tokens, device, eos)
    rows.append(dict(part="grpo", system="HF transformers generate", sampling="greedy", setting=setting,
                     tokens=sum(len(t) for t in hf_tokens), seconds=hf_s, steps=max(len(t) for t in hf_tokens)))
    plain_g, plain_g_s = run_engine(e := engine(), greedy)
    rows.append(result_row("engine, no speculation", "greedy", e, plain_g, plain_g_s, part="grpo", setting=setting))
    same_hf = sum(plain_g[r.request_id].token_ids == hf_tokens[i] for i, r in enumerate(greedy))
    rows[-1]["identical_to"] = f"HF generate: {same_hf}/{len(greedy)}"
    sampled = grpo_requests(records, num_prompts, samples, 1.0, max_tokens, eos)
    plain, plain_s = run_engine(e := engine(), sampled)
    rows.append(result_row("engine, no speculation", "T=1", e, plain, plain_s, part="grpo", setting=setting))
    spec, spec_s = run_engine(e := engine(drafter()), sampled)
    rows.append(result_row("engine + HistoDrafter, recorded earlier epochs", "T=1", e, spec, spec_s, part="grpo",
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
    rows.append(result_row("engine, no speculation", "greedy", e, ours1, ours1_s, part="b1", setting="batch 1"))
    rows[-1]["identical_to"] = f"HF generate: {ours1['r0'].token_ids == hf1[0]}"
    summary["speedup_vs_hf_b1"] = (len(ours1["r0"].token_ids) / ours1_s) / (len(hf1[0]) / hf1_s)
    return rows, summary
