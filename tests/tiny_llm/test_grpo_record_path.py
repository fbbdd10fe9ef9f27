"""The example GRPO trainer's --record path: a missing directory is created (the README's
command on a fresh clone, `--record runs/grpo.npz` without runs/), and a path that cannot
be written fails before the first step and any weight push, in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.tiny_llm import train_sft
from benchmarks.tiny_llm.examples import load_example
from benchmarks.tiny_llm.local_client import LocalRolloutClient
from services.common.traces import read_traces
from services.rollout.loader import init_random_model

grpo = load_example("grpo_trainer")

MICRO = dataclasses.replace(
    train_sft.PRESETS["tiny"], hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("micro")
    train_sft.save_checkpoint(init_random_model(train_sft.model_config(MICRO), seed=0), path)
    return str(path)


class NoCallsClient:
    """Fails the test on any call: the trainer must stop before it talks to the service."""

    def __getattr__(self, name):
        raise AssertionError(f"the trainer called the service ({name}) before checking its record path")


def test_write_traces_creates_a_missing_directory(tmp_path):
    path = tmp_path / "runs" / "deeper" / "grpo.npz"
    row = {"prompt_id": "p0", "epoch": 0, "sample_index": 0, "policy_version": 0, "reward": 1.0, "prompt": [1, 2],
           "response": [3, 4, 5], "old_logprobs": np.array([-0.1, -0.2, -0.3], dtype=np.float32)}
    grpo.write_traces(str(path), [row])
    [record] = read_traces(path)
    assert record.prompt_id == "p0" and list(record.token_ids) == [3, 4, 5]
    assert not (path.parent / "grpo.npz.tmp").exists()


def test_a_run_records_into_a_directory_that_does_not_exist_yet(model_dir, tmp_path, monkeypatch):
    """The README's command, relative path and all, from a directory without runs/."""
    monkeypatch.chdir(tmp_path)
    client = LocalRolloutClient(model_dir)
    stats = grpo.run(client, model_dir, steps=2, num_prompts=2, n=2, max_tokens=6, seed=0,
                     record="runs/grpo.npz", log=lambda line: None)
    assert [s["version"] for s in stats] == [1, 2]
    assert len(read_traces(tmp_path / "runs" / "grpo.npz")) == 8
    assert (tmp_path / "runs" / "grpo.npz.state.pt").exists()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["grpo.npz", "grpo.npz.state.pt"]


def test_prepare_record_path_creates_the_directory_and_leaves_nothing_else(tmp_path):
    record = tmp_path / "a" / "b" / "grpo.npz"
    grpo.prepare_record_path(str(record))
    assert record.parent.is_dir() and list(record.parent.iterdir()) == []


@pytest.mark.parametrize("bad", ["under_a_file", "a_directory"])
def test_an_unwritable_record_path_fails_before_any_call_to_the_service(model_dir, tmp_path, bad):
    (tmp_path / "plain_file").write_text("not a directory")
    (tmp_path / "grpo.npz").mkdir()
    record = str(tmp_path / "plain_file" / "grpo.npz") if bad == "under_a_file" else str(tmp_path / "grpo.npz")
    with pytest.raises(grpo.RecordPathError, match="record: cannot write the trace file"):
        grpo.run(NoCallsClient(), model_dir, steps=1, num_prompts=2, n=2, max_tokens=6, record=record)


def test_the_cli_reports_an_unwritable_record_path_in_one_line(model_dir, tmp_path, monkeypatch):
    (tmp_path / "plain_file").write_text("not a directory")
    record = str(tmp_path / "plain_file" / "grpo.npz")
    monkeypatch.setattr("rhymerl.RolloutClient", lambda *args, **kwargs: _Closable())
    with pytest.raises(SystemExit) as exit_info:
        grpo.main(["--address", "localhost:1", "--model-dir", model_dir, "--steps", "1", "--record", record])
    message = str(exit_info.value.code)
    assert message.startswith("grpo_trainer.py: error: --record: cannot write the trace file")
    assert record in message and "\n" not in message


class _Closable(NoCallsClient):
    def close(self) -> None:
        pass
