"""engine_bench's CPU part: a tiny random model, our engine vs HF generate, and our engine
with history drafts from an exact (oracle) or an other-seed earlier epoch."""

from __future__ import annotations

import torch

from benchmarks.engine_run import request, result_row, run_engine
from benchmarks.hf_generate import hf_generate
from services.rollout.drafter import HistoDrafter
from services.rollout.engine import EngineRequest, LLMEngine
from services.rollout.loader import init_random_model
from services.rollout.models.config import ModelConfig

TINY = ModelConfig(
    architecture="qwen2", vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=1024, tie_word_embeddings=True, attention_bias=True,
    qk_norm=False, eos_token_ids=(0,), bos_token_id=None, dtype="float32")


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
        rows.append(result_row("engine, no speculation", label, e, plain, plain_s))
        if temperature == 0.0:
            same = all(plain[f"r{i}"].token_ids == hf_tokens[i] for i in range(len(hf_tokens)))
            rows[-1]["identical_to"] = f"HF generate: {same}"
        # (a) previous epoch = exactly this run's responses (oracle history)
        oracle, oracle_s = run_engine(e := engine(history_drafter(by_prompt(plain))), reqs(temperature, 0))
        rows.append(result_row("engine + HistoDrafter, exact history", label, e, oracle, oracle_s))
        rows[-1]["identical_to"] = f"no speculation: {_same(plain, oracle)}"
        # (b) previous epoch sampled with other seeds (greedy: history from T=1 samples)
        other, _ = run_engine(engine(), reqs(1.0, 10_000))
        noisy, noisy_s = run_engine(e := engine(history_drafter(by_prompt(other))), reqs(temperature, 0))
        rows.append(result_row("engine + HistoDrafter, other-seed history", label, e, noisy, noisy_s))
        rows[-1]["identical_to"] = f"no speculation: {_same(plain, noisy)}"
    return rows


def _same(a: dict, b: dict) -> bool:
    return all(a[k].token_ids == b[k].token_ids and
               max((abs(x - y) for x, y in zip(a[k].logprobs, b[k].logprobs)), default=0.0) < 1e-4 for k in a)
