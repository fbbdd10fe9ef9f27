"""Checkpoint files <-> CausalLM.

If these fail, the worker cannot load what the trainer saves (or the trainer's tools
cannot load what we save), or it loads the wrong tensors silently.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch

from services.rollout.loader import init_random_model, load_model, read_config, read_safetensors, save_model
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
)


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """One sequence through our model: [num_tokens, vocab_size]."""
    cu_seqlens = torch.tensor([0, input_ids.numel()])
    with torch.no_grad():
        return model.compute_logits(model(input_ids, packed_positions(cu_seqlens), DenseCausalAttention(cu_seqlens)))


@pytest.mark.parametrize(
    ("family", "extra"),
    [("llama", {"tie_word_embeddings": True}), ("qwen2", {}), ("qwen3", {"head_dim": 24})],
)
def test_save_model_loads_in_transformers_with_equal_logits(family, extra, tmp_path):
    """What we save (e.g. a trained policy) is a valid HF checkpoint of the same model."""
    config = ModelConfig.from_hf({"model_type": family, "eos_token_id": [3, 4], **TINY, **extra})
    model = init_random_model(config, seed=11)
    save_model(model, tmp_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(reference).__name__.lower().startswith(family)
    input_ids = torch.randint(0, TINY["vocab_size"], (23,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(input_ids[None]).logits[0].float()
    assert (logits(model, input_ids) - expected).abs().max().item() < 1e-4
    assert (logits(load_model(tmp_path), input_ids) - expected).abs().max().item() < 1e-4


def test_save_model_does_not_duplicate_tied_lm_head(tmp_path):
    config = ModelConfig.from_hf({"model_type": "llama", "tie_word_embeddings": True, **TINY})
    save_model(init_random_model(config, seed=0), tmp_path)
    names = set(read_safetensors(tmp_path / "model.safetensors"))
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_save_model_writes_weight_dtype_and_extra_config(tmp_path):
    config = ModelConfig.from_hf({"model_type": "qwen2", "torch_dtype": "float32", **TINY})
    save_model(init_random_model(config, seed=0).to(torch.bfloat16), tmp_path, extra_config={"policy_version": 7})
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["policy_version"] == 7 and written["torch_dtype"] == "bfloat16"
    loaded = load_model(tmp_path)
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16 and loaded.config.dtype == "bfloat16"
    assert not list(tmp_path.glob(".*tmp*")), "temporary files left behind"


def test_load_model_dtype_override(tmp_path):
    config = ModelConfig.from_hf({"model_type": "qwen3", "torch_dtype": "bfloat16", **TINY})
    save_model(init_random_model(config, seed=0), tmp_path)
    model = load_model(tmp_path, dtype=torch.float32)
    assert model.lm_head.weight.dtype == torch.float32 and model.config.dtype == "float32"
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


def test_load_model_reads_sharded_checkpoint(tmp_path):
    """Real checkpoints above a few GB come as shards listed in model.safetensors.index.json."""
    hf_config = transformers.Qwen2Config(**TINY)
    torch.manual_seed(0)
    reference = transformers.Qwen2ForCausalLM(hf_config).eval()
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model = load_model(tmp_path)
    ours = model.expected_weights()
    for name, param in reference.named_parameters():
        assert torch.equal(ours[name], param), name


def test_save_model_refuses_to_write_over_a_sharded_checkpoint(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    model = init_random_model(ModelConfig.from_hf({"model_type": "llama", **TINY}), seed=0)
    with pytest.raises(FileExistsError):
        save_model(model, tmp_path)


def test_load_model_without_weights_fails_clearly(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)


def test_read_safetensors_from_bytes_equals_from_file(tmp_path):
    """Weights pushed over gRPC arrive as bytes, not files."""
    tensors = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    safetensors.torch.save_file(tensors, tmp_path / "w.safetensors")
    from_bytes = read_safetensors(safetensors.torch.save(tensors))
    from_file = read_safetensors(tmp_path / "w.safetensors")
    for name, tensor in tensors.items():
        assert torch.equal(from_bytes[name], tensor) and torch.equal(from_file[name], tensor)
        assert from_bytes[name].dtype == tensor.dtype


def test_read_config_adds_generation_config_stop_tokens(tmp_path):
    """Chat models end turns with a token that only generation_config.json names."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "eos_token_id": 9, **TINY}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 11]}))
    assert read_config(tmp_path).eos_token_ids == (9, 11)
