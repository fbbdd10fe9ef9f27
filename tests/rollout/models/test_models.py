"""CausalLM against Hugging Face transformers, the reference for what a checkpoint means.

If these fail, the rollout worker samples from a different distribution than the policy
the trainer optimises (or cannot load its checkpoint at all).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.loader import init_random_model, load_model
from services.rollout.models.base import DenseCausalAttention, packed_positions
from services.rollout.models.config import ModelConfig

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
SEQ_LENS = (7, 19, 1, 12)


def hf_model(family: str, seed: int, **overrides) -> torch.nn.Module:
    """A tiny HF model with every parameter random (norm weights and biases included)."""
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[family]
    config = config_class(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    return model


def packed_batch(seed: int, vocab_size: int = TINY["vocab_size"]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids [num_tokens], cu_seqlens [num_seqs + 1]) for sequences of SEQ_LENS."""
    generator = torch.Generator().manual_seed(seed)
    cu_seqlens = torch.tensor([0, *SEQ_LENS]).cumsum(0)
    return torch.randint(0, vocab_size, (sum(SEQ_LENS),), generator=generator), cu_seqlens


def our_logits(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        hidden = model(input_ids, packed_positions(cu_seqlens), DenseCausalAttention(cu_seqlens))
        return model.compute_logits(hidden)


def hf_logits(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each sequence run on its own, concatenated: [num_tokens, vocab_size]."""
    with torch.no_grad():
        return torch.cat([
            model(input_ids[start:end][None]).logits[0].float()
            for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
        ])


CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 24}),  # explicit head_dim != hidden / heads
    "llama3_rope_tied": (
        "llama",
        {
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
            # small original context so that all three llama3 frequency bands occur at head_dim 16
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "llama_attention_bias": ("llama", {"attention_bias": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, tmp_path):
    """A checkpoint saved by transformers loads into CausalLM with the same logits on a packed
    batch (positions restart per sequence; no attention across sequences)."""
    family, overrides = CASES[case]
    reference = hf_model(family, seed=1, **overrides)
    reference.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.config.architecture == family
    input_ids, cu_seqlens = packed_batch(seed=2)
    expected = hf_logits(reference, input_ids, cu_seqlens)
    actual = our_logits(model, input_ids, cu_seqlens)
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert (actual - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_the_serving_forward_equals_the_training_forward_bit_for_bit_on_the_cpu(family, tmp_path, monkeypatch):
    """Serving (no autograd) carries the residual stream beside each layer's output and adds
    it in the next norm's fused call; training runs each add and norm on its own. On the
    CPU the fused calls are their references, the same ops: the same hidden states, bit for
    bit. Through the fused Triton kernel (the interpreter) they agree to its rounding."""
    import kernels.fused as fused
    from services.rollout.models import transformer

    path = tmp_path / family
    hf_model(family, seed=5).save_pretrained(path, safe_serialization=True)
    model = load_model(path, "cpu", torch.float32)
    input_ids, cu_seqlens = packed_batch(seed=6)
    positions = packed_positions(cu_seqlens)
    with torch.enable_grad():
        training = model(input_ids, positions, DenseCausalAttention(cu_seqlens)).detach()
    with torch.no_grad():
        assert torch.equal(model(input_ids, positions, DenseCausalAttention(cu_seqlens)), training)
        monkeypatch.setattr(transformer, "add_rms_norm", fused.add_rms_norm_triton)
        fused_kernel = model(input_ids, positions, DenseCausalAttention(cu_seqlens))
    torch.testing.assert_close(fused_kernel, training, atol=1e-4, rtol=1e-4)


def test_llama3_rope_scaling_is_parsed_not_ignored(tmp_path):
    """The llama3 case above only proves something if the scaling reached the model."""
    _, overrides = CASES["llama3_rope_tied"]
    hf_model("llama", seed=1, **overrides).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.rope_scaling["rope_type"] == "llama3"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dense_attention_matches_one_sequence_at_a_time():
    """Packing sequences must not let one attend to another, and padding must not leak."""
    model = init_random_model(ModelConfig.from_hf({"model_type": "qwen2", **TINY}), seed=3)
    input_ids, cu_seqlens = packed_batch(seed=4)
    packed = our_logits(model, input_ids, cu_seqlens)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        alone = our_logits(model, input_ids[start:end], torch.tensor([0, end - start]))
        assert torch.allclose(packed[start:end], alone, atol=1e-5)


def brute_force_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """Softmax attention written out per sequence and per query head, in float64."""
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for length in seq_lens:
        for i in range(start, start + length):
            heads = []
            for h in range(q.shape[1]):
                keys, values = k[start : i + 1, h // group].double(), v[start : i + 1, h // group].double()
                weights = torch.softmax(keys @ q[i, h].double() / q.shape[2] ** 0.5, dim=0)
                heads.append(weights @ values)
            out.append(torch.stack(heads))
        start += length
    return torch.stack(out)


@settings(max_examples=25, deadline=None)
@given(
    seq_lens=st.lists(st.integers(1, 9), min_size=1, max_size=5),
    num_kv_heads=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
def test_dense_attention_matches_brute_force(seq_lens, num_kv_heads, seed):
    """Any packing of any lengths, with grouped kv heads, is per-sequence causal attention."""
    generator = torch.Generator().manual_seed(seed)
    num_tokens = sum(seq_lens)
    q = torch.randn(num_tokens, 4, 8, generator=generator)
    k = torch.randn(num_tokens, num_kv_heads, 8, generator=generator)
    v = torch.randn(num_tokens, num_kv_heads, 8, generator=generator)
    cu_seqlens = torch.tensor([0, *seq_lens]).cumsum(0)
    out = DenseCausalAttention(cu_seqlens)(0, q, k, v)
    assert out.shape == q.shape
    assert torch.allclose(out.double(), brute_force_attention(q, k, v, seq_lens), atol=1e-5)


def test_dense_attention_gradients_are_finite_and_local():
    """Training backpropagates through the padded layout: no NaN from padding rows, and a
    sequence's loss has no gradient on another sequence's tokens."""
    model = init_random_model(ModelConfig.from_hf({"model_type": "llama", **TINY}), seed=5)
    input_ids, cu_seqlens = packed_batch(seed=6)
    hidden = model.model.embed_tokens(input_ids).detach().requires_grad_(True)
    attn = DenseCausalAttention(cu_seqlens)
    q = hidden.view(-1, 4, 16)
    out = attn(0, q, q[:, :2], q[:, 2:])
    first_end = SEQ_LENS[0]
    out[:first_end].sum().backward()
    assert torch.isfinite(hidden.grad).all()
    assert hidden.grad[:first_end].abs().sum() > 0
    assert hidden.grad[first_end:].abs().sum() == 0


def test_packed_positions_restart_per_sequence():
    assert packed_positions(torch.tensor([0, 3, 4, 6])).tolist() == [0, 1, 2, 0, 0, 1]


def test_load_weights_rejects_missing_tensor_by_name():
    model = init_random_model(ModelConfig.from_hf({"model_type": "qwen3", **TINY}), seed=0)
    state = model.state_dict()
    del state["model.layers.1.self_attn.k_norm.weight"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        model.load_weights(state)


def test_load_weights_rejects_misshaped_tensor_and_leaves_model_untouched():
    model = init_random_model(ModelConfig.from_hf({"model_type": "llama", **TINY}), seed=0)
    before = model.state_dict()
    state = {name: torch.zeros_like(p) for name, p in before.items()}
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(95, 64)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(95, 64\)"):
        model.load_weights(state)
    for name, p in model.state_dict().items():
        assert torch.equal(p, before[name]), name


def test_load_weights_rejects_unknown_tensor():
    """A bias the config does not declare means the config and the weights disagree."""
    model = init_random_model(ModelConfig.from_hf({"model_type": "llama", **TINY}), seed=0)
    state = model.state_dict()
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        model.load_weights(state)


def test_load_weights_copies_in_place():
    """A running engine keeps pointers (CUDA graphs) to the parameters' storage."""
    config = ModelConfig.from_hf({"model_type": "qwen2", **TINY})
    model, source = init_random_model(config, seed=0), init_random_model(config, seed=1)
    pointers = {name: p.data_ptr() for name, p in model.named_parameters()}
    model.load_weights(source.state_dict())
    for name, p in model.named_parameters():
        assert p.data_ptr() == pointers[name], name
        assert torch.equal(p, source.get_parameter(name)), name


def assert_fused_weights_hold(model, state: dict[str, torch.Tensor]) -> None:
    """Each layer's fused q/k/v weight and bias and gate/up weight are the HF tensors of
    `state`, stacked in that order, bit for bit."""
    for i, layer in enumerate(model.model.layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for param, names in [
            (layer.self_attn.qkv_proj.weight, [attn + p + "_proj.weight" for p in "qkv"]),
            (layer.self_attn.qkv_proj.bias, [attn + p + "_proj.bias" for p in "qkv"]),
            (layer.mlp.gate_up_proj.weight, [mlp + "gate_proj.weight", mlp + "up_proj.weight"]),
        ]:
            assert torch.equal(param, torch.cat([state[name] for name in names])), names


def test_fused_projections_hold_exactly_the_checkpoints_tensors_after_a_load_and_a_push(tmp_path):
    """q/k/v (with Qwen2's biases) and gate/up each run as one matmul over one fused
    weight; loading a checkpoint and applying a pushed one must write every HF-named
    tensor into its own rows of it. (The logits tests cannot see a k/v mix-up where
    k_proj and v_proj have the same shape and random values.)"""
    import safetensors.torch

    from services.rollout import weight_receiver
    from services.rollout.engine import LLMEngine
    from services.rollout.loader import read_safetensors

    reference = hf_model("qwen2", seed=1)
    reference.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    assert_fused_weights_hold(model, reference.state_dict())
    # A push: HF-named safetensors bytes, read and checked as the worker does, into the engine.
    pushed = hf_model("qwen2", seed=2).state_dict()
    engine = LLMEngine(model, device="cpu", num_kv_blocks=16, speculative=False)
    engine.load_weights(weight_receiver.check_finite(read_safetensors(safetensors.torch.save(pushed))))
    assert_fused_weights_hold(engine.model, pushed)


def test_fused_projections_keep_one_copy_of_the_weights():
    """No q/k/v or gate/up parameter besides the fused ones: the HF-named tensors are views
    of the fused storage, so the model holds exactly as many weights as the checkpoint."""
    model = init_random_model(ModelConfig.from_hf({"model_type": "qwen2", **TINY}), seed=0)
    modules = {name.split(".")[-2] for name, _ in model.named_parameters() if "layers." in name}
    assert modules == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "input_layernorm",
                       "post_attention_layernorm"}
    assert [name for name, _ in model.named_buffers()] == ["model.rotary_emb.inv_freq"]
    weights = model.expected_weights()
    assert sum(p.numel() for p in model.parameters()) == sum(t.numel() for t in weights.values())
    layer = model.model.layers[1]
    for name, fused in [("self_attn.v_proj.weight", layer.self_attn.qkv_proj.weight),
                        ("self_attn.k_proj.bias", layer.self_attn.qkv_proj.bias),
                        ("mlp.up_proj.weight", layer.mlp.gate_up_proj.weight)]:
        view = weights["model.layers.1." + name]
        assert view.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr(), name


def test_state_dict_has_the_checkpoints_names_and_loads_back():
    """A trainer's state_dict round trip and safetensors export see HF's names, each tensor
    with its own storage; strict loading names what is missing or unexpected."""
    import safetensors.torch

    config = ModelConfig.from_hf({"model_type": "qwen2", **TINY})
    source, target = init_random_model(config, seed=0), init_random_model(config, seed=1)
    state = source.state_dict()
    assert set(state) == set(hf_model("qwen2", seed=0).state_dict())
    assert safetensors.torch.load(safetensors.torch.save(state)).keys() == state.keys()  # no shared storage
    target.load_state_dict(state)
    assert_fused_weights_hold(target, state)
    assert all(torch.equal(p, source.get_parameter(n)) for n, p in target.named_parameters())
    missing = dict(state)
    del missing["model.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(RuntimeError, match=r"Missing.*model\.layers\.0\.self_attn\.k_proj\.bias"):
        target.load_state_dict(missing)
    with pytest.raises(RuntimeError, match=r"Unexpected.*model\.layers\.0\.mlp\.up_proj\.bias"):
        target.load_state_dict({**state, "model.layers.0.mlp.up_proj.bias": torch.zeros(96)})


def test_every_tensor_the_forward_reads_keeps_its_address_when_the_model_is_moved_to_where_it_is():
    """Each LLMEngine calls model.to(device) on the model it is given, and CUDA graphs
    captured by an engine read its parameters and buffers by address. A second engine over
    the same model (the benchmarks build several) must not replace any of them: the RoPE
    frequencies once were, and the first engine's graphs then read freed memory (on the
    H200 its plain runs stopped ending). The frequencies stay float32, exact."""
    from services.rollout.engine import LLMEngine

    model = init_random_model(ModelConfig.from_hf({"model_type": "qwen2", **TINY}), seed=0)
    # As on a GPU: the buffer is a device copy of the module's CPU float32 frequencies (on
    # the CPU it would otherwise be that very tensor, and no replacement could show).
    model.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq.clone()
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    pointers = {name: t.data_ptr() for name, t in tensors.items()}
    want = model.model.rotary_emb.inv_freq.clone()
    for step in (lambda m: m.to("cpu"), lambda m: m.to(torch.float32), lambda m: m.eval(),
                 lambda m: LLMEngine(m, device="cpu", num_kv_blocks=16, speculative=False).model,
                 lambda m: LLMEngine(m, device="cpu", num_kv_blocks=16, speculative=False).model):
        model = step(model)
        now = dict(model.named_parameters()) | dict(model.named_buffers())
        assert {name: t.data_ptr() for name, t in now.items()} == pointers
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(model.model.rotary_emb.inv_freq, want)
    with torch.inference_mode():
        model.to("cpu")  # inside the engine's inference mode too
    assert model.model.rotary_emb.inv_freq.data_ptr() == pointers["model.rotary_emb.inv_freq"]


def test_init_random_model_is_deterministic_and_in_config_dtype():
    config = ModelConfig.from_hf({"model_type": "qwen3", "torch_dtype": "bfloat16", **TINY})
    a, b, c = (init_random_model(config, seed) for seed in (7, 7, 8))
    assert a.model.embed_tokens.weight.dtype == torch.bfloat16
    assert a.model.rotary_emb.inv_freq.dtype == torch.float32
    assert all(torch.equal(p, b.get_parameter(n)) for n, p in a.named_parameters())
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


@pytest.mark.parametrize(
    ("hf", "field"),
    [
        ({"architectures": ["MistralForCausalLM"], **TINY}, "architectures"),
        ({"model_type": "gemma", **TINY}, "model_type"),
        ({"model_type": "qwen2", "use_sliding_window": True, **TINY}, "use_sliding_window"),
        ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, **TINY}, "rope_scaling"),
        ({"model_type": "llama", "hidden_act": "gelu", **TINY}, "hidden_act"),
        ({"model_type": "llama", "torch_dtype": "float8_e4m3fn", **TINY}, "torch_dtype"),
        ({"model_type": "llama", **{k: v for k, v in TINY.items() if k != "vocab_size"}}, "vocab_size"),
    ],
)
def test_from_hf_rejects_unsupported_config_naming_the_field(hf, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf(hf)


def test_from_hf_reads_both_rope_dialects():
    """transformers 4.x writes rope_theta + rope_scaling, 5.x writes rope_parameters."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    old = ModelConfig.from_hf({"model_type": "llama", "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}, **TINY})
    new = ModelConfig.from_hf(
        {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}, **TINY}
    )
    assert old == new
    assert old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "llama3", **scaling}


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_to_hf_is_read_back_by_transformers_and_from_hf(family):
    config = ModelConfig.from_hf({"model_type": family, "head_dim": 32, "eos_token_id": [5, 6], **TINY})
    hf = config.to_hf()
    assert ModelConfig.from_hf(hf) == config
    hf_config = transformers.AutoConfig.for_model(**hf)
    assert type(hf_config).__name__.lower().startswith(family)
    assert (hf_config.head_dim, hf_config.num_key_value_heads) == (32, 2)
