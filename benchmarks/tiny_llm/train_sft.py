"""Supervised warm-up of the measured policy: a small decoder trained from scratch on
worked answers of the reasoning task, saved as a Hugging Face checkpoint.

    python -m benchmarks.tiny_llm.train_sft --preset tiny --out models/tiny --seed 0

Writes into --out: config.json + model.safetensors (rhymerl's loader and HF transformers
both load it), the tokenizer files, and train_log.json (loss curve, timing, greedy
rewards on held-out problems). Training is deterministic given the seed: fixed data,
fixed batch order, torch.manual_seed (on CPU; CUDA kernels may differ in the last bits).

Presets: `tiny` trains on 2 CPU cores in under 3 minutes (the policy `make run` and the
tests use); `small` (~25M parameters) is meant for one GPU, with bf16 autocast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.tiny_llm.examples import load_example
from benchmarks.tiny_llm.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    build_tokenizer,
    save_tokenizer,
    vocabulary,
)
from services.rollout.loader import init_random_model, save_model
from services.rollout.models.base import DenseCausalAttention, packed_positions
from services.rollout.models.config import ModelConfig

task = load_example("reasoning_task")

# Training problems come from this seed offset, held-out evaluation problems from another,
# so --seed changes both but never makes them the same set.
_TRAIN_SET, _EVAL_SET = 1_000_003, 2_000_003


@dataclass(frozen=True)
class Preset:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    num_problems: int  # size of the training set of worked answers
    num_steps: int
    tokens_per_batch: int  # padded tokens (sequences x longest) per optimizer step
    lr: float
    warmup_steps: int
    weight_decay: float = 0.01


PRESETS = {
    "tiny": Preset(
        architecture="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        num_problems=12000, num_steps=480, tokens_per_batch=2048, lr=4e-3, warmup_steps=30,
    ),
    "small": Preset(
        architecture="qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
        num_problems=120_000, num_steps=2000, tokens_per_batch=32768, lr=1e-3, warmup_steps=100,
    ),
}  # fmt: skip


def model_config(preset: Preset) -> ModelConfig:
    """The decoder shape of a preset, over the task tokenizer's vocabulary."""
    return ModelConfig(
        architecture=preset.architecture,
        vocab_size=len(vocabulary()),
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=True,
        attention_bias=preset.architecture == "qwen2",
        qk_norm=preset.architecture == "qwen3",
        eos_token_ids=(EOS_ID,),
        bos_token_id=BOS_ID,
        dtype="float32",
    )


# ---- data -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Example:
    token_ids: list[int]  # <bos> prompt response <eos>
    num_prompt_tokens: int  # <bos> included; the loss covers only the tokens after these


def make_examples(num_problems: int, seed: int, max_len: int) -> list[Example]:
    """Worked answers to `num_problems` training problems, those longer than `max_len` dropped."""
    tokenizer = build_tokenizer()
    examples = []
    for problem in task.sample_problems(num_problems, seed + _TRAIN_SET):
        prompt = tokenizer.encode(problem.prompt).ids  # <bos> prepended
        response = tokenizer.encode(task.worked_answer(problem), add_special_tokens=False).ids
        if len(prompt) + len(response) + 1 <= max_len:
            examples.append(Example(prompt + response + [EOS_ID], len(prompt)))
    return examples


def make_batches(examples: list[Example], tokens_per_batch: int, seed: int) -> list[list[Example]]:
    """Length-bucketed batches (little padding in the dense attention), in seeded order."""
    ordered = sorted(examples, key=lambda e: len(e.token_ids))
    batches, current = [], []
    for example in ordered:
        # Sorted ascending, so this example is the batch's longest.
        if current and (len(current) + 1) * len(example.token_ids) > tokens_per_batch:
            batches.append(current)
            current = []
        current.append(example)
    if current:
        batches.append(current)
    random.Random(seed).shuffle(batches)
    return batches


@dataclass(frozen=True)
class PackedBatch:
    input_ids: torch.Tensor  # [num_tokens] int64, sequences concatenated
    positions: torch.Tensor  # [num_tokens] int64
    cu_seqlens: torch.Tensor  # [num_seqs + 1] int64
    target_index: torch.Tensor  # [num_targets] index of the token predicting each target
    targets: torch.Tensor  # [num_targets] int64


def pack(batch: list[Example], device: torch.device) -> PackedBatch:
    input_ids, cu_seqlens, target_index, targets = [], [0], [], []
    for example in batch:
        start = cu_seqlens[-1]
        input_ids.extend(example.token_ids)
        # Token t predicts token t+1; only response tokens (and <eos>) are targets.
        target_index.extend(range(start + example.num_prompt_tokens - 1, start + len(example.token_ids) - 1))
        targets.extend(example.token_ids[example.num_prompt_tokens :])
        cu_seqlens.append(start + len(example.token_ids))
    cu = torch.tensor(cu_seqlens, dtype=torch.int64, device=device)
    return PackedBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=packed_positions(cu),
        cu_seqlens=cu,
        target_index=torch.tensor(target_index, dtype=torch.int64, device=device),
        targets=torch.tensor(targets, dtype=torch.int64, device=device),
    )


# ---- training -------------------------------------------------------------------------


def batch_loss(model, batch: PackedBatch, autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Mean next-token cross-entropy over the batch's response tokens."""
    device_type = batch.input_ids.device.type
    with torch.autocast(device_type, dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
        hidden = model(batch.input_ids, batch.positions, DenseCausalAttention(batch.cu_seqlens))  # [num_tokens, H]
        logits = model.compute_logits(hidden[batch.target_index])  # [num_targets, vocab] float32
    return F.cross_entropy(logits.float(), batch.targets)


def learning_rate(preset: Preset, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < preset.warmup_steps:
        return preset.lr * (step + 1) / preset.warmup_steps
    progress = (step - preset.warmup_steps) / max(1, preset.num_steps - preset.warmup_steps)
    return preset.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def train(preset: Preset, seed: int, device: str = "cpu", log_every: int = 20, log=print):
    """Trains a fresh model; returns (model, losses per step)."""
    torch.manual_seed(seed)
    device = torch.device(device)
    model = init_random_model(model_config(preset), seed).to(device)
    model.train()
    examples = make_examples(preset.num_problems, seed, preset.max_position_embeddings)
    batches: list[list[Example]] = []
    num_passes = 0
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=preset.weight_decay
    )
    autocast_dtype = torch.bfloat16 if device.type == "cuda" else None
    losses: list[float] = []
    start, num_tokens = time.perf_counter(), 0
    for step in range(preset.num_steps):
        if not batches:  # a new pass over the data, in a new seeded order
            batches = make_batches(examples, preset.tokens_per_batch, seed + 7919 * num_passes)[::-1]
            num_passes += 1
        batch = pack(batches.pop(), device)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(preset, step)
        loss = batch_loss(model, batch, autocast_dtype)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        num_tokens += batch.input_ids.numel()
        if (step + 1) % log_every == 0 or step + 1 == preset.num_steps:
            elapsed = time.perf_counter() - start
            recent = losses[-log_every:]
            log(
                f"step {step + 1}/{preset.num_steps}  loss {sum(recent) / len(recent):.4f}  "
                f"lr {learning_rate(preset, step):.2e}  {num_tokens / elapsed:,.0f} tok/s  {elapsed:.0f}s"
            )
    model.eval()
    return model, losses


def save_checkpoint(model, out: str | Path) -> None:
    """The float32 model (config.json + model.safetensors) and the tokenizer files, in `out`."""
    save_model(model.float().cpu(), out)
    save_tokenizer(out)


# ---- checking the result --------------------------------------------------------------


@torch.no_grad()
def greedy_rewards(
    model_dir: str | Path, num_problems: int, seed: int, device: str = "cpu", max_new_tokens: int = 384
) -> list[float]:
    """Rewards of greedy responses (HF transformers generate) to held-out problems."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    problems = task.make_prompts(num_problems, seed + _EVAL_SET)
    encoded = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True).to(device)
    output = model.generate(
        **encoded, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    responses = tokenizer.batch_decode(output[:, encoded.input_ids.shape[1] :], skip_special_tokens=True)
    return [task.reward(p, r) for p, r in zip(problems, responses)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--out", required=True, help="checkpoint directory to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, help="override the preset's number of steps")
    # One thread by default on CPU: the tiny model's matmuls are too small to gain from a
    # second one, and on a shared machine a spinning second thread costs several times more.
    parser.add_argument("--threads", type=int, default=1, help="CPU threads for torch")
    parser.add_argument("--eval-problems", type=int, default=32, help="held-out problems to sample greedily")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    preset = PRESETS[args.preset]
    if args.steps is not None:
        preset = dataclasses.replace(preset, num_steps=args.steps)
    num_params = sum(p.numel() for p in init_random_model(model_config(preset), 0).parameters())
    print(f"preset {args.preset}: {num_params / 1e6:.2f}M parameters, {preset.num_steps} steps on {args.device}")
    start = time.perf_counter()
    model, losses = train(preset, args.seed, args.device)
    train_s = time.perf_counter() - start
    save_checkpoint(model, args.out)
    rewards = greedy_rewards(args.out, args.eval_problems, args.seed, args.device) if args.eval_problems else []
    mean_reward = sum(rewards) / len(rewards) if rewards else float("nan")
    final_loss = sum(losses[-20:]) / len(losses[-20:])
    print(
        f"trained in {train_s:.0f}s, loss over the last 20 steps {final_loss:.4f} (cross-entropy of the worked "
        f"solutions); greedy reward {mean_reward:.3f} on {len(rewards)} held-out problems (the task reward, 0..1, "
        "of its most likely answer, temperature 0)"
    )
    log = {
        "preset": args.preset,
        "preset_values": dataclasses.asdict(preset),
        "seed": args.seed,
        "device": args.device,
        "num_parameters": num_params,
        "train_seconds": round(train_s, 1),
        "losses": [round(x, 5) for x in losses],
        "greedy_rewards": rewards,
    }
    (Path(args.out) / "train_log.json").write_text(json.dumps(log) + "\n")


if __name__ == "__main__":
    main()
