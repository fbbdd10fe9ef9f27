"""SFT warm-up: it learns, it is reproducible, and what it saves loads the same in rhymerl's
loader and in HF transformers (the trainer's copy and the workers' copy must agree)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from benchmarks.tiny_llm import train_sft
from benchmarks.tiny_llm.examples import load_example
from benchmarks.tiny_llm.tokenizer import BOS_ID, EOS_ID
from services.rollout.loader import init_random_model, load_model
from services.rollout.models.base import DenseCausalAttention, packed_positions

task = load_example("reasoning_task")

# The tiny preset's shape, shrunk so a few steps take a second.
MICRO = dataclasses.replace(
    train_sft.PRESETS["tiny"], hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, num_problems=300, num_steps=15, tokens_per_batch=1024, warmup_steps=2,
)  # fmt: skip


def test_a_few_steps_lower_the_loss():
    """Loss falls well below its start within 15 steps (else the data or the masks are broken)."""
    torch.set_num_threads(1)
    _, losses = train_sft.train(MICRO, seed=0, log=lambda line: None)
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses


def test_training_is_deterministic_from_the_seed():
    short = dataclasses.replace(MICRO, num_steps=3)
    assert train_sft.train(short, 1, log=lambda _: None)[1] == train_sft.train(short, 1, log=lambda _: None)[1]


def test_examples_mask_the_prompt_and_end_with_eos():
    """Targets are the response and <eos>; batches respect the padded-token budget."""
    examples = train_sft.make_examples(50, seed=0, max_len=2048)
    batch = train_sft.pack(examples[:3], torch.device("cpu"))
    e = examples[0]
    assert e.token_ids[0] == BOS_ID and e.token_ids[-1] == EOS_ID
    assert batch.targets[: len(e.token_ids) - e.num_prompt_tokens].tolist() == e.token_ids[e.num_prompt_tokens :]
    assert (batch.input_ids[batch.target_index + 1] == batch.targets).all()
    for b in train_sft.make_batches(examples, 1024, seed=0):
        assert len(b) == 1 or len(b) * max(len(x.token_ids) for x in b) <= 1024


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_checkpoint_loads_with_equal_logits_in_rhymerl_and_hf(tmp_path, architecture):
    """Both presets' families: our loader and AutoModelForCausalLM give the same float32 logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = train_sft.model_config(dataclasses.replace(MICRO, architecture=architecture))
    train_sft.save_checkpoint(init_random_model(config, seed=3), tmp_path)
    ours = load_model(tmp_path, "cpu", torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    sequences = [tokenizer(p.prompt + task.worked_answer(p)).input_ids for p in task.make_prompts(3, seed=0)]
    cu = torch.tensor([0] + [sum(map(len, sequences[: i + 1])) for i in range(len(sequences))])
    with torch.no_grad():
        flat = torch.tensor([t for s in sequences for t in s])
        logits = ours.compute_logits(ours(flat, packed_positions(cu), DenseCausalAttention(cu)))  # [T, vocab]
        reference = torch.cat([hf(torch.tensor([s])).logits[0] for s in sequences]).float()
    assert logits.shape == reference.shape
    assert (logits - reference).abs().max().item() < 1e-4
    assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == EOS_ID


def test_cli_writes_a_loadable_checkpoint_and_log(tmp_path, monkeypatch):
    monkeypatch.setitem(train_sft.PRESETS, "micro", dataclasses.replace(MICRO, num_steps=2))
    out = tmp_path / "ckpt"
    train_sft.main(["--preset", "micro", "--out", str(out), "--seed", "0", "--eval-problems", "2"])
    log = json.loads((out / "train_log.json").read_text())
    assert len(log["losses"]) == 2 and len(log["greedy_rewards"]) == 2
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
