"""benchmarks.e2e_bench's choice of model: what runs without starting any service."""

from __future__ import annotations

import json

import pytest

from benchmarks import e2e_bench


def test_smollm2_is_served_at_its_own_shape(capsys):
    with pytest.raises(SystemExit) as exc:
        e2e_bench.main(["--model", "smollm2", "--widen", "Qwen2.5-0.5B"])
    assert exc.value.code == 2
    assert "--model smollm2 is served at its own shape" in capsys.readouterr().err


def test_each_task_writes_its_own_results(tmp_path):
    """The real policy's run never overwrites the tiny policy's e2e.json, and each file says its task."""
    base = dict(device="cpu", ratio_kind="a CPU ratio", commit="abc", command="c", setting="s", baseline="b",
                rhymerl="r", notes=[], epochs=[], mean_ratio=None)
    e2e_bench.write(tmp_path, dict(base, task="reasoning"))
    e2e_bench.write(tmp_path, dict(base, task="words"))
    assert json.loads((tmp_path / "e2e.json").read_text())["task"] == "reasoning"
    assert json.loads((tmp_path / "e2e_smollm2.json").read_text())["task"] == "words"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e2e.json", "e2e.md", "e2e_smollm2.json", "e2e_smollm2.md"]
