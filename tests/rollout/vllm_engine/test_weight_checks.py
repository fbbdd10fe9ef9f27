"""The vLLM engine's weight push is checked whole against the checkpoint it started from
before vLLM sees it (vLLM loads whatever names and dtypes it is given): no vLLM needed,
the engine's own checks against a real safetensors checkpoint."""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import save_file

from services.rollout.vllm_engine.builder import checkpoint_specs
from services.rollout.vllm_engine.engine import VllmEngine


class FakeLLM:
    """What VllmEngine.load_weights calls on vLLM's engine: records the pushes."""

    def __init__(self):
        self.model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace())
        self.loaded = []

    def collective_rpc(self, fn, args=(), kwargs=None):
        self.loaded.append(args[0])
        return [None]

    def reset_prefix_cache(self):
        pass


@pytest.fixture
def weights():
    return {"embed.weight": torch.randn(8, 4, dtype=torch.bfloat16), "norm.weight": torch.ones(4),
            "pos.ids": torch.arange(6, dtype=torch.int64)}


@pytest.fixture
def engine(tmp_path, weights):
    save_file(weights, str(tmp_path / "model.safetensors"))
    specs = checkpoint_specs(str(tmp_path))
    assert specs == {"embed.weight": ((8, 4), "BF16"), "norm.weight": ((4,), "F32"), "pos.ids": ((6,), "I64")}
    llm = FakeLLM()
    return VllmEngine(llm, speculative=False, eos_token_ids=frozenset(), max_model_len=64, weight_specs=specs)


def test_a_push_of_the_checkpoints_names_shapes_and_dtypes_is_loaded(engine, weights):
    engine.load_weights(weights)
    # another floating-point precision is converted by vLLM's loader, as by rhymerl's engine
    engine.load_weights({**weights, "embed.weight": weights["embed.weight"].float()})
    assert len(engine.llm.loaded) == 2


@pytest.mark.parametrize("name, tensor, says", [
    ("embed.weight", torch.zeros(8, 4, dtype=torch.int32), "wrong dtype ['embed.weight (int32, expected BF16)']"),
    ("norm.weight", torch.ones(4, dtype=torch.bool), "wrong dtype ['norm.weight (bool, expected F32)']"),
    ("norm.weight", torch.ones(4, dtype=torch.complex64), "wrong dtype ['norm.weight (complex64, expected F32)']"),
    ("pos.ids", torch.arange(6, dtype=torch.float32), "wrong dtype ['pos.ids (float32, expected I64)']"),
    ("norm.weight", torch.ones(5), "mis-shaped ['norm.weight']"),
])
def test_a_push_with_a_wrong_dtype_or_shape_is_refused_naming_the_tensor(engine, weights, name, tensor, says):
    with pytest.raises(ValueError) as err:
        engine.load_weights({**weights, name: tensor})
    assert says in str(err.value)
    assert engine.llm.loaded == []  # nothing reached vLLM


def test_a_partial_or_foreign_push_is_refused(engine, weights):
    partial = dict(weights)
    partial.pop("norm.weight")
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        engine.load_weights(partial)
    with pytest.raises(ValueError, match=r"unknown \['extra'\]"):
        engine.load_weights({**weights, "extra": torch.ones(1)})
    assert engine.llm.loaded == []
