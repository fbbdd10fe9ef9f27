"""The example GRPO trainer, against an in-process stand-in for the SDK client.

Checks the RL math (group-normalised advantages, the clipped ratio, updates that move
logprobs the way the advantages say), that the trainer's recomputed logprobs match the
sampler's, that weights pushed as safetensors bytes load, and the recorded traces.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from rhymerl import SamplingParams

from benchmarks.tiny_llm import train_sft
from benchmarks.tiny_llm.examples import load_example
from benchmarks.tiny_llm.local_client import LocalRolloutClient
from services.common.traces import read_traces
from services.rollout.loader import init_random_model

grpo = load_example("grpo_trainer")
task = load_example("reasoning_task")

MICRO = dataclasses.replace(
    train_sft.PRESETS["tiny"], hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16,
)  # fmt: skip


def save_micro_checkpoint(path) -> str:
    """A random checkpoint of the MICRO config in ``path`` (what the GRPO example trains)."""
    train_sft.save_checkpoint(init_random_model(train_sft.model_config(MICRO), seed=0), path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_micro_checkpoint(tmp_path_factory.mktemp("micro"))


def test_advantages_are_normalised_per_group():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    adv = grpo.group_advantages(rewards)
    np.testing.assert_allclose(adv[0], [1, -1, -1, 1], atol=1e-5)
    np.testing.assert_array_equal(adv[1], 0.0)  # no signal in a uniform group
    assert adv[2, 3] > 0 and (adv[2, :3] < 0).all()
    np.testing.assert_allclose(adv.mean(axis=1), 0.0, atol=1e-6)


def test_aborted_samples_are_left_out_of_their_group():
    """An aborted sample gets advantage 0 and does not shift its siblings' baseline."""
    from types import SimpleNamespace

    group = [SimpleNamespace(key=("p", i), finish_reason=f) for i, f in enumerate(["stop", "length", "abort"])]
    rewards = {("p", 0): 1.0, ("p", 1): 0.0, ("p", 2): 1.0}
    adv = grpo.step_advantages({"p": group}, rewards)
    assert adv[("p", 2)] == 0.0
    assert adv[("p", 0)] == pytest.approx(1.0, abs=1e-5) and adv[("p", 1)] == pytest.approx(-1.0, abs=1e-5)


def test_clipped_loss_stops_the_gradient_outside_the_trust_region():
    """PPO clip: no push beyond 1+eps for A>0 or below 1-eps for A<0; plain ratio*A inside."""
    old = torch.zeros(4)
    new = torch.log(torch.tensor([1.5, 1.1, 0.5, 0.9])).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    grpo.clipped_policy_loss(new, old, adv, clip_eps=0.2).backward()
    grad = new.grad.tolist()
    assert grad[0] == 0.0 and grad[2] == 0.0
    assert grad[1] == pytest.approx(-1.0 * 1.1 / 4) and grad[3] == pytest.approx(1.0 * 0.9 / 4)


def test_trainer_logprobs_match_the_sampler(model_dir):
    """At the start the importance ratio is 1: the trainer recomputes the sampled logprobs."""
    client = LocalRolloutClient(model_dir)
    prompts = grpo.encode_prompts(client.tokenizer, task.make_prompts(3, seed=0))
    result = client.rollout("s", prompts, 2, SamplingParams(temperature=0.7, max_tokens=12, seed=1))
    assert len(result.samples) == 6
    pairs = [(next(p.token_ids for p in prompts if p.prompt_id == s.prompt_id), s.token_ids) for s in result.samples]
    with torch.no_grad():
        recomputed = grpo.response_logprobs(client.model, pairs, temperature=0.7)
    for s, lp in zip(result.samples, recomputed):
        np.testing.assert_allclose(lp.numpy(), s.logprobs, atol=1e-4)


def test_update_moves_logprobs_the_way_the_advantages_say(model_dir):
    """After an update, reward-weighted logprob rises: good samples likelier, bad ones less."""
    client = LocalRolloutClient(model_dir)
    torch.manual_seed(0)
    prompts = grpo.encode_prompts(client.tokenizer, task.make_prompts(2, seed=0))
    result = client.rollout("s", prompts, 4, SamplingParams(temperature=1.0, max_tokens=10, seed=2))
    prompt_of = {p.prompt_id: p.token_ids for p in prompts}
    advantages = grpo.group_advantages(np.array([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])).ravel()
    batch = [
        {"prompt": prompt_of[s.prompt_id], "response": s.token_ids, "advantage": float(a),
         "old_logprobs": np.asarray(s.logprobs, dtype=np.float32)}
        for s, a in zip(result.samples, advantages)
    ]  # fmt: skip
    config = grpo.GRPOConfig(lr=1e-2, num_updates=1, temperature=1.0)
    optimizer = torch.optim.AdamW(client.model.parameters(), lr=config.lr)
    loss = grpo.policy_update(client.model, optimizer, batch, config)
    # ratio 1 at the start: the loss is minus the token-mean advantage
    lengths = np.array([len(b["response"]) for b in batch])
    assert loss == pytest.approx(-(advantages * lengths).sum() / lengths.sum(), abs=1e-5)
    with torch.no_grad():
        after = grpo.response_logprobs(client.model, [(b["prompt"], b["response"]) for b in batch], 1.0)
    moved = [(lp.sum() - torch.tensor(b["old_logprobs"]).sum()).item() for lp, b in zip(after, batch)]
    assert sum(a * m for a, m in zip(advantages, moved)) > 0
    assert all(m > 0 for a, m in zip(advantages, moved) if a > 0)


def test_run_pushes_weights_reports_rewards_and_records_traces(model_dir, tmp_path):
    """Two RL epochs end to end through the SDK surface; the trace file reads back."""
    client = LocalRolloutClient(model_dir)
    record = tmp_path / "traces.npz"
    lines = []
    stats = grpo.run(
        client, model_dir, steps=2, num_prompts=3, n=2, max_tokens=8, seed=0, record=str(record), log=lines.append
    )
    assert [s["version"] for s in stats] == [1, 2] and client.version == 2
    assert len(lines) == 3 and lines[0].endswith("starting at policy version 0") and "history match" in lines[2]
    assert np.isnan(stats[0]["history_match"]) and 0.0 <= stats[1]["history_match"] <= 1.0
    run_id = lines[0].split()[1].rstrip(":")
    assert sorted(client.rewards) == [f"grpo-{run_id}-step0-v0", f"grpo-{run_id}-step1-v1"]
    assert all(len(r) == 6 for r in client.rewards.values())
    records = read_traces(record)
    assert len(records) == 12 and {r.epoch for r in records} == {0, 1}
    assert {r.policy_version for r in records if r.epoch == 1} == {1}
    first = records[0]
    assert len(first.token_ids) == len(first.logprobs) and first.prompt_token_ids[0] == 1
    assert 0 < len(first.token_ids) <= 8


def test_pushed_weights_load_into_the_rollout_workers_model(model_dir):
    """The bytes push_weights sends are what rhymerl's CausalLM.load_weights accepts."""
    from transformers import AutoModelForCausalLM

    from services.rollout.loader import load_model, read_safetensors

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.model.embed_tokens.weight.add_(1.0)
    tensors = read_safetensors(grpo.weights_bytes(model))
    assert "lm_head.weight" not in tensors  # tied: it is the embedding
    worker_model = load_model(model_dir, "cpu", torch.float32)
    worker_model.load_weights(tensors)
    torch.testing.assert_close(worker_model.model.embed_tokens.weight, model.model.embed_tokens.weight)
    torch.testing.assert_close(worker_model.lm_head.weight, model.model.embed_tokens.weight)


def test_train_layers_updates_only_the_last_layers_and_the_final_norm(model_dir):
    """--train-layers 1: the update changes the last decoder layer and the final norm, and
    nothing else (the tied embedding included); 0 trains every parameter."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert len(grpo.trainable_parameters(model, 0)) == len(list(model.parameters()))
    with pytest.raises(ValueError, match="train_layers"):
        grpo.trainable_parameters(model, 3)
    trained = grpo.trainable_parameters(model, 1)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    client = LocalRolloutClient(model_dir)
    prompts = grpo.encode_prompts(client.tokenizer, task.make_prompts(2, seed=0))
    result = client.rollout("s", prompts, 2, SamplingParams(temperature=1.0, max_tokens=8, seed=2))
    prompt_of = {p.prompt_id: p.token_ids for p in prompts}
    batch = [{"prompt": prompt_of[s.prompt_id], "response": s.token_ids, "advantage": a,
              "old_logprobs": np.asarray(s.logprobs, dtype=np.float32)}
             for s, a in zip(result.samples, [1.0, -1.0, 1.0, -1.0])]  # fmt: skip
    config = grpo.GRPOConfig(lr=1e-2, num_updates=1, temperature=1.0)
    grpo.policy_update(model, torch.optim.AdamW(trained, lr=config.lr), batch, config)
    last = len(model.model.layers) - 1
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        expected = name.startswith(f"model.layers.{last}.") or name == "model.norm.weight"
        assert changed == expected, name


def test_a_resumed_recording_equals_an_uninterrupted_one(model_dir, tmp_path, monkeypatch):
    """A recording stopped after its first step and resumed against a fresh service makes
    the same trace and ends on the same policy as one run straight through: the trained
    parameters, the optimizer's moments and the trace so far come back from the state file."""
    # A random micro model never solves a problem: a reward that varies within groups, so every step updates.
    monkeypatch.setattr(task, "reward", lambda problem, text, partial_credit=0.0: len(text) % 3 / 2)
    options = dict(num_prompts=3, n=2, max_tokens=8, seed=0, train_layers=1, lr=1e-2, partial_credit=0.5)
    straight = LocalRolloutClient(model_dir)
    grpo.run(straight, model_dir, steps=3, record=str(tmp_path / "straight.npz"), **options)
    cut, first_lines = str(tmp_path / "cut.npz"), []
    grpo.run(LocalRolloutClient(model_dir), model_dir, steps=1, record=cut, log=first_lines.append, **options)
    resumed, lines = LocalRolloutClient(model_dir), []
    stats = grpo.run(resumed, model_dir, steps=3, record=cut, resume=True, log=lines.append, **options)
    assert "resumed" in lines[0] and [s["version"] for s in stats] == [1, 2, 3] and resumed.version == 3
    # under the recorded run's id: a trainer restarted mid-step rejoins the step it had submitted
    run_id = first_lines[0].split()[1].rstrip(":")
    assert lines[0].startswith(f"run {run_id}: ")
    assert sorted(resumed.rewards) == [f"grpo-{run_id}-step1-v1", f"grpo-{run_id}-step2-v2"]
    assert all(s["loss"] != 0.0 for s in stats)  # every step did update the policy
    a, b = read_traces(tmp_path / "straight.npz"), read_traces(cut)
    assert [(r.epoch, r.prompt_id, r.sample_index, list(r.token_ids), r.reward) for r in a] == \
        [(r.epoch, r.prompt_id, r.sample_index, list(r.token_ids), r.reward) for r in b]
    for (name, x), y in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(x, y), name
    with pytest.raises(ValueError, match="resume: seed is 1, the recorded run used 0"):
        grpo.run(LocalRolloutClient(model_dir), model_dir, steps=3, record=cut, resume=True,
                 **dict(options, seed=1))
    with pytest.raises(ValueError, match=f"resume: run_id is 'other', the recorded run used '{run_id}'"):
        grpo.run(LocalRolloutClient(model_dir), model_dir, steps=3, record=cut, resume=True, run_id="other",
                 **options)


# The --record path: a missing directory is created (the README's command on a fresh clone,
# `--record runs/grpo.npz` without runs/), and a path that cannot be written fails before
# the first step and any weight push, in one line.

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
