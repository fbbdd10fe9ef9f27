"""A widened checkpoint samples exactly what its source samples.

If these fail, the GPU campaign's speedups at real shapes (docs/gpu.md) measure a model
that no longer behaves like the trained policy: its drafts from history would be accepted
at another rate, and its figures would say nothing about the policy's rhyme.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.engine_run import request
from services.rollout.engine import LLMEngine, run_to_completion
from services.rollout.loader import init_random_model, load_model, save_model
from services.rollout.models.config import ModelConfig
from services.rollout.models.widen import SHAPES, Shape, named_shape, widen_checkpoint, widen_model, widened_config

SOURCE = ModelConfig(
    architecture="llama", vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True, attention_bias=False,
    qk_norm=False, eos_token_ids=(0,), bos_token_id=None, dtype="float32")
# hidden = heads * head_dim (what transformers' Qwen2 assumes), GQA groups 3 >= 2, head_dim x2, one extra layer
TARGET = Shape(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, head_dim=16, vocab_size=80)
PROMPTS = [[5, 9, 3, 17, 22, 8], [41, 2, 2, 7], [13] * 9]


def sample(model, temperature: float, max_tokens: int = 24) -> dict:
    engine = LLMEngine(model, device="cpu", max_num_seqs=8, max_num_batched_tokens=256, block_size=16,
                       num_kv_blocks=64, speculative=False)
    reqs = [request(i, p, seed=100 + i, temperature=temperature, max_tokens=max_tokens) for i, p in enumerate(PROMPTS)]
    return run_to_completion(engine, reqs)


def assert_same_samples(a: dict, b: dict) -> None:
    for key in a:
        assert a[key].token_ids == b[key].token_ids, key
        diff = max(abs(x - y) for x, y in zip(a[key].logprobs, b[key].logprobs))
        assert diff < 1e-5, (key, diff)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_samples_the_same_tokens_and_logprobs(tied, temperature):
    source = init_random_model(dataclasses.replace(SOURCE, tie_word_embeddings=tied), seed=1)
    wide = widen_model(source, TARGET, seed=2)
    assert wide.config.num_hidden_layers == 3 and wide.config.vocab_size == 80
    assert_same_samples(sample(source, temperature), sample(wide, temperature))


def test_a_qwen2_source_with_biases_and_llama3_rope_is_kept():
    config = dataclasses.replace(SOURCE, architecture="qwen2", attention_bias=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    source = init_random_model(config, seed=3)
    assert_same_samples(sample(source, 1.0), sample(widen_model(source, TARGET, seed=4), 1.0))


def test_padded_tokens_have_zero_probability_and_the_logprobs_match():
    source = init_random_model(SOURCE, seed=5)
    wide = widen_model(source, TARGET, seed=6)
    ids = torch.tensor([3, 14, 15, 9, 26, 5, 35])
    from services.rollout.models.base import DenseCausalAttention

    def logprobs(model):
        attn = DenseCausalAttention(torch.tensor([0, len(ids)]))
        with torch.no_grad():
            hidden = model(ids, torch.arange(len(ids)), attn)
            return torch.log_softmax(model.compute_logits(hidden), dim=-1)

    small, big = logprobs(source), logprobs(wide)
    assert torch.all(big[:, SOURCE.vocab_size:].exp() == 0)
    assert torch.allclose(small, big[:, :SOURCE.vocab_size], atol=1e-5, rtol=0)


def test_transformers_loads_the_widened_checkpoint_and_generates_the_same(tmp_path):
    transformers = pytest.importorskip("transformers")
    source = init_random_model(SOURCE, seed=7)
    save_model(source, tmp_path / "small")
    widen_checkpoint(tmp_path / "small", tmp_path / "wide", TARGET, seed=8, dtype=torch.float32)
    assert load_model(tmp_path / "wide").config.architecture == "qwen2"
    hf = {name: transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32).eval()
          for name in ("small", "wide")}
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        small, wide = (torch.log_softmax(hf[n](prompt).logits.float(), -1) for n in ("small", "wide"))
    assert torch.all(wide[..., SOURCE.vocab_size:].exp() == 0)
    assert torch.allclose(small, wide[..., :SOURCE.vocab_size], atol=1e-5, rtol=0)
    greedy = [hf[n].generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None)[0]
              for n in ("small", "wide")]
    assert greedy[0].tolist() == greedy[1].tolist()
    # T=1: each model's own forward, one exponential race per step with the same noise on
    # the real tokens (HF's multinomial draws differently over a longer vocabulary)
    noise = torch.empty(16, SOURCE.vocab_size).exponential_(generator=torch.Generator().manual_seed(0))
    sampled = {}
    for name, model in hf.items():
        ids = prompt
        for step in range(16):
            with torch.no_grad():
                probs = torch.softmax(model(ids).logits[0, -1].float(), -1)
            race = probs[:SOURCE.vocab_size] / noise[step]
            if name == "wide":
                race = torch.cat([race, probs[SOURCE.vocab_size:]])
            ids = torch.cat([ids, race.argmax().view(1, 1)], dim=1)
        sampled[name] = ids[0].tolist()
    assert sampled["small"] == sampled["wide"] and max(sampled["wide"]) < SOURCE.vocab_size


@pytest.mark.parametrize("field, shape", [
    ("hidden_size", dataclasses.replace(TARGET, hidden_size=32)),
    ("head_dim", dataclasses.replace(TARGET, head_dim=12)),
    ("num_attention_heads", dataclasses.replace(TARGET, num_attention_heads=2, num_key_value_heads=2)),
    ("vocab_size", dataclasses.replace(TARGET, vocab_size=40)),
    ("num_hidden_layers", dataclasses.replace(TARGET, num_hidden_layers=1)),
])
def test_a_shape_that_cannot_hold_the_source_is_refused_naming_the_field(field, shape):
    with pytest.raises(ValueError, match=f"^{field}:"):
        widened_config(SOURCE, shape)


def test_a_qwen3_source_is_refused():
    with pytest.raises(ValueError, match="^architecture:"):
        widened_config(dataclasses.replace(SOURCE, architecture="qwen3", qk_norm=True), TARGET)
    with pytest.raises(ValueError, match="^shape: unknown"):
        named_shape("Qwen2.5-70B")


@pytest.mark.slow
def test_at_the_real_width_and_vocabulary_the_samples_are_the_same():
    """The Qwen2.5-0.5B width, head_dim and vocabulary of 151,936 (source layers only: the
    extra layers are the small test's), with the tiny policy's own shape as the source."""
    tiny = dataclasses.replace(SOURCE, vocab_size=46, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                               head_dim=32)
    shape = named_shape("Qwen2.5-0.5B", num_layers=4)
    assert (shape.hidden_size, shape.vocab_size, shape.head_dim) == (896, 151936, 64)
    source = init_random_model(tiny, seed=9)
    wide = widen_model(source, shape, seed=10)
    for temperature in (0.0, 1.0):
        assert_same_samples(sample(source, temperature, 12), sample(wide, temperature, 12))


def test_the_named_shapes_are_qwen25s():
    assert SHAPES["Qwen2.5-1.5B"] == Shape(1536, 8960, 28, 12, 2, 128, 151936)
    assert named_shape("Qwen2.5-1.5B", 8).num_hidden_layers == 8
