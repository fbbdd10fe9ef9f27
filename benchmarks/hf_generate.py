"""The reference engine_bench compares against: HF transformers `generate`, greedy, all
prompts in one batch."""

from __future__ import annotations

import tempfile
import time

import torch

from services.rollout.loader import save_model
from services.rollout.models.transformer import CausalLM


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
    hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=4, pad_token_id=pad)  # warm-up
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
