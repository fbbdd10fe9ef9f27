"""The sampling contract, measured on the worker's engine against the model's own logits
(an independent full forward, not the sampler the engine uses): greedy is the argmax and
deterministic, a seed fixes the sample, sampled frequencies follow the exact truncated
softmax (chi-square, small vocabulary), logprobs are log-softmax of the logits / T.

tests/kernels/test_sampling.py checks the sampler alone; this file checks that what the
engine returns is that sampler applied to this model's logits, end to end.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.rollout.engine import EngineRequest, LLMEngine, run_to_completion
from services.rollout.loader import init_random_model
from services.rollout.models.base import DenseCausalAttention
from services.rollout.models.config import ModelConfig

VOCAB = 12
CONFIG = ModelConfig(
    architecture="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False, attention_bias=True,
    qk_norm=False, eos_token_ids=(0,), bos_token_id=None, dtype="float32")
PROMPT = [3, 7, 1, 9, 4]
# chi-square critical values at p = 0.001 by degrees of freedom (fixed seeds: deterministic)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
            10: 29.59, 11: 31.26}


@pytest.fixture(scope="module")
def model():
    m = init_random_model(CONFIG, seed=3)
    with torch.no_grad():  # sharper logits than the init's, so truncation cuts real mass
        m.lm_head.weight.mul_(4.0)
    return m


def request(i: int, seed: int, max_tokens: int = 1, prompt=PROMPT, **kw) -> EngineRequest:
    fields = dict(request_id=f"r{i}", prompt_id="p", step_id="s", sample_index=i, prompt_token_ids=list(prompt),
                  generated_token_ids=[], temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed,
                  max_tokens=max_tokens, max_new_tokens=max_tokens, stop_token_ids=frozenset(), min_tokens=0,
                  ignore_eos=True, logprobs=True)
    fields.update(kw)
    return EngineRequest(**fields)


def generate(model, reqs, **engine_kw) -> dict:
    engine = LLMEngine(model, device="cpu", num_kv_blocks=512, block_size=8, max_num_seqs=256,
                       max_num_batched_tokens=512, speculative=False, **engine_kw)
    return run_to_completion(engine, reqs)


@torch.inference_mode()
def model_logits(model, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float64 logits of one full dense forward."""
    ids = torch.tensor(tokens)
    hidden = model.forward(ids, torch.arange(len(tokens)), DenseCausalAttention(torch.tensor([0, len(tokens)])))
    return model.compute_logits(hidden).double()


def exact_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """softmax(logits / T), top-k, then top-p on the renormalised top-k; float64."""
    probs = torch.softmax(logits / temperature, -1)
    order = sorted(range(len(probs)), key=lambda v: (-float(probs[v]), v))
    kept = order[:top_k] if 0 < top_k < len(order) else order
    mass = sum(float(probs[v]) for v in kept)
    if 0 < top_p < 1:
        out, before = [], 0.0
        for v in kept:
            if before >= top_p:
                break
            out.append(v)
            before += float(probs[v]) / mass
        kept = out
    total = sum(float(probs[v]) for v in kept)
    return {v: float(probs[v]) / total for v in kept}


def test_greedy_is_the_argmax_every_step_and_deterministic(model):
    reqs = lambda: [request(i, seed=100 + i, max_tokens=12, temperature=0.0) for i in range(3)]  # noqa: E731
    a, b = generate(model, reqs()), generate(model, reqs())
    tokens = a["r0"].token_ids
    assert all(a[r].token_ids == tokens == b[r].token_ids for r in a), "greedy depends on the seed or the run"
    logits = model_logits(model, PROMPT + tokens)[len(PROMPT) - 1:-1]  # [12, vocab]
    assert tokens == logits.argmax(-1).tolist()


def test_same_seed_same_sample_other_seed_other_sample(model):
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.95, top_k=8)
    a = generate(model, [request(i, seed=7 + i, **kw) for i in range(6)])
    b = generate(model, [request(i, seed=7 + i, **kw) for i in reversed(range(6))])  # other batch order
    assert {r: o.token_ids for r, o in a.items()} == {r: o.token_ids for r, o in b.items()}
    assert len({tuple(o.token_ids) for o in a.values()}) > 1, "different seeds gave one sample"


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                                        (1.0, 0, 0.8), (1.0, 6, 0.9)])
def test_first_token_frequencies_match_the_exact_distribution(model, temperature, top_k, top_p):
    """Chi-square of 3,000 seeded samples against the exact truncated softmax of the logits."""
    n = 3000
    outs = generate(model, [request(i, seed=1000 + i, temperature=temperature, top_k=top_k, top_p=top_p)
                            for i in range(n)])
    expected = exact_distribution(model_logits(model, PROMPT)[-1], temperature, top_k, top_p)
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in outs.values()]), minlength=VOCAB)
    assert int(sum(counts[v] for v in expected)) == n, ("a truncated token was sampled", counts.tolist())
    assert len(expected) >= 2
    chi2 = sum((int(counts[v]) - n * p) ** 2 / (n * p) for v, p in expected.items())
    assert chi2 < CHI2_999[len(expected) - 1], (chi2, counts.tolist(), expected)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 4, 0.9), (0.0, 0, 1.0)])
def test_logprobs_are_log_softmax_of_the_model_logits(model, temperature, top_k, top_p):
    """Each returned logprob is log_softmax(logits / T)[token] (T = 1 for greedy), untruncated,
    computed here from one dense forward over prompt + sample."""
    outs = generate(model, [request(i, seed=50 + i, max_tokens=20, temperature=temperature, top_k=top_k,
                                    top_p=top_p, prompt=PROMPT[: 2 + i]) for i in range(3)])
    for i in range(3):
        prompt, o = PROMPT[: 2 + i], outs[f"r{i}"]
        logits = model_logits(model, prompt + o.token_ids)[len(prompt) - 1:-1]  # [20, vocab]
        expected = torch.log_softmax(logits / (temperature or 1.0), -1).gather(
            1, torch.tensor(o.token_ids)[:, None]).squeeze(1)
        assert len(o.logprobs) == len(o.token_ids) == 20
        assert torch.allclose(torch.tensor(o.logprobs, dtype=torch.float64), expected, atol=1e-4), i
        assert all(math.isfinite(lp) and lp <= 0 for lp in o.logprobs)
