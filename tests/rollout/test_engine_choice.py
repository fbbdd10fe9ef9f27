"""The worker's engine as its settings build it (services/rollout/engine_choice.py)."""

from __future__ import annotations

import pytest

from services.common.errors import SettingError
from services.rollout.drafter.compiled import LIBRARY_ENV, DrafterLibraryError
from services.rollout.engine_choice import build_engine
from services.rollout.loader import init_random_model, save_model
from services.rollout.models.config import ModelConfig
from services.rollout.settings import WorkerSettings

CONFIG = ModelConfig(
    architecture="llama", vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=True, attention_bias=False, qk_norm=False,
    eos_token_ids=(2,), bos_token_id=None, dtype="float32")


@pytest.fixture
def checkpoint(tmp_path):
    save_model(init_random_model(CONFIG, seed=0), tmp_path / "model")
    return str(tmp_path / "model")


def settings(model_path: str, **kw) -> WorkerSettings:
    return WorkerSettings(model_path=model_path, device="cpu", num_kv_blocks=16, measure_cost=False, **kw)


def test_a_worker_without_speculation_needs_no_drafter_library(checkpoint, tmp_path, monkeypatch):
    """check_drafter lets a worker with --no-speculative start without the compiled
    drafter's library (it never drafts); build_engine made the compiled drafter anyway, so
    the worker still refused to start, with "could not start: DrafterLibraryError"."""
    monkeypatch.setenv(LIBRARY_ENV, str(tmp_path / "missing.so"))
    engine = build_engine(settings(checkpoint, speculative=False), "w")
    assert engine.drafter is None and not engine.speculative
    with pytest.raises(DrafterLibraryError, match="make install"):  # a drafting worker still needs it
        build_engine(settings(checkpoint), "w")


def test_a_checkpoint_that_does_not_load_is_a_setting_error_naming_the_file(checkpoint, tmp_path):
    """The command line names --model-path for a SettingError (services/cli.py); the message
    names the file that is wrong."""
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(SettingError, match="model.safetensors: Error while deserializing") as caught:
        build_engine(settings(checkpoint, speculative=False), "w")
    assert caught.value.setting == "model_path"
    (tmp_path / "model" / "config.json").write_text("{")
    with pytest.raises(SettingError, match="config.json: ") as caught:
        build_engine(settings(checkpoint, speculative=False), "w")
    assert caught.value.setting == "model_path"
