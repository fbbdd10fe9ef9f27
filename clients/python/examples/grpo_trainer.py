"""An example GRPO trainer that gets its rollouts from rhymerl, through the SDK only.

The trainer's own copy of the policy is a Hugging Face transformers model, as in veRL or
TRL; rhymerl's workers hold another copy and receive every update as safetensors bytes.

    python grpo_trainer.py --address localhost:50051 --model-dir models/tiny --steps 8
    python grpo_trainer.py --address localhost:50051 --model-dir models/smollm2-135m \
        --task words --train-layers 2 --steps 2 --prompts 4 --n 4 --max-tokens 32

Two tasks: `reasoning` (reasoning_task.py: worked arithmetic in a closed vocabulary, for
the tiny policy) and `words` (word_problems.py: English word problems for a pretrained
chat model). Prompts go through the tokenizer's chat template when it has one; the
service gets token ids and returns token ids (token-in/token-out), decoded here only to
score them.

One step is one RL epoch over a fixed prompt set (every prompt recurs every step, which is
what lets rhymerl draft from history):
  1. submit the prompts x n samples (sampled by policy version `version`);
  2. score each response with the task reward, report the rewards to the service;
  3. advantages: each reward minus its group's mean, over the group's std;
  4. a few PPO-clipped gradient steps on the returned logprobs (ratio new/old);
  5. push the new weights as version + 1.
Per step it prints the reward, the mean response length, the share of generated tokens a
longest-suffix match against the same prompt's previous-step responses predicts, the
service's draft acceptance (accepted / proposed draft tokens), the rollout and update
times, the first PPO loss of the update (clipped surrogate, sign as minimised), and the
version the update was pushed as (`-> vN`).

Runs against one service: versions start from the one the service serves
(`client.stats().policy_version`). Against a service an earlier run already updated, the
trainer first pushes its starting weights as the next version, so its first step samples
its own policy. Step ids are `grpo-<run id>-step<k>-v<version>`, the run id fresh for every
run (UTC time, pid, random) unless --run-id gives one: a run never replays another's
samples, while a restarted trainer given its run id again (or --resume, which keeps the
recorded one) rejoins the steps it had submitted at the same policy version, getting their
samples instead of generating them twice. Ctrl-C cancels the step in flight in the service
(the SDK's cancel_on_interrupt).

--record PATH writes every rollout as a trace file (a compressed .npz; layout in
`write_traces` below, the same as services/common/traces.py reads), after every step,
and keeps the run's state beside it (PATH.state.pt: the trained parameters, the
optimizer, the trace so far). PATH's directory is created if missing; a PATH that cannot
be written fails before the first step, in one line. --resume continues such a run from
its last finished step, against a fresh service or the same one: the policy it had reached
is pushed first (under its recorded version, or the next one when the service serves a
later one), and the epochs that follow are the ones the uninterrupted run would have made (a
long recording can span several sittings).
"""

# No `from __future__ import annotations`: a launcher may load this file with
# importlib without registering it in sys.modules, where string annotations break
# @dataclass on Python < 3.12.
import argparse
import dataclasses
import errno
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as safetensors_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # examples are scripts, not a package
import reasoning_task as task  # noqa: E402
import word_problems  # noqa: E402

from rhymerl import Prompt, SamplingParams  # noqa: E402

TASKS = {"reasoning": task, "words": word_problems}


@dataclass(frozen=True)
class GRPOConfig:
    steps: int = 8  # RL epochs: each samples every prompt once
    num_prompts: int = 16
    n: int = 8  # samples per prompt (the GRPO group)
    max_tokens: int = 512
    temperature: float = 1.0
    seed: int = 0
    lr: float = 2e-4
    clip_eps: float = 0.2
    num_updates: int = 2  # gradient steps per RL step on the same rollouts
    tokens_per_microbatch: int = 8192  # padded tokens per forward/backward
    partial_credit: float = 0.0
    record: str | None = None
    # With record: continue that run from its last finished step (state kept beside the trace)
    resume: bool = False
    device: str = "cpu"  # where the trainer's copy of the policy learns
    task: str = "reasoning"  # a key of TASKS
    # 0: every parameter learns; k > 0: only the last k decoder layers and the final norm
    # (a pretrained model's update sized for a CPU; the whole model is still pushed)
    train_layers: int = 0
    # Names the run's step ids (grpo-<run_id>-step<k>-v<version>); None: a fresh one
    # (new_run_id). The same id again rejoins (replays) that run's steps at the same
    # version; a resumed recording keeps its recorded id.
    run_id: str | None = None


def new_run_id() -> str:
    """A run id no other run has: UTC time, process id and a random suffix
    (e.g. 20250101T120000-4242-9f3a), so two runs never share a step id."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}-{secrets.token_hex(2)}"


def step_id_of(run_id: str, step: int, version: int) -> str:
    """The step id of RL step `step` of run `run_id`, sampled at policy `version`. The
    version is part of it: a step id is the service's idempotency key for the step's
    whole content, the policy version asked for included, so a rejoining trainer that
    resumes at another version starts a new step rather than failing as a changed one."""
    return f"grpo-{run_id}-step{step}-v{version}"


def serving_version(client) -> int:
    """The policy version the service serves now (``client.stats()``); 0 for a stand-in
    client without ``stats``, which starts from the checkpoint."""
    stats = getattr(client, "stats", None)
    return 0 if stats is None else stats().policy_version


def encode_prompts(tokenizer, problems: list) -> list[Prompt]:
    """Each problem's token ids: its text as the user's turn of the tokenizer's chat
    template, ready for the assistant's answer, or the plain text without a template."""
    if getattr(tokenizer, "chat_template", None):
        return [Prompt(p.prompt_id, list(tokenizer.apply_chat_template(
            [{"role": "user", "content": p.prompt}], add_generation_prompt=True, return_dict=False)))
            for p in problems]  # fmt: skip
    return [Prompt(p.prompt_id, tokenizer(p.prompt).input_ids) for p in problems]


def trainable_parameters(model, train_layers: int) -> list:
    """The parameters the update changes (see GRPOConfig.train_layers); freezes the rest."""
    if train_layers <= 0:
        return list(model.parameters())
    layers = model.model.layers
    if train_layers > len(layers):
        raise ValueError(f"train_layers: {train_layers}, the model has {len(layers)} decoder layers")
    model.requires_grad_(False)
    trained = [*layers[len(layers) - train_layers:], model.model.norm]
    for module in trained:
        module.requires_grad_(True)
    return [p for module in trained for p in module.parameters()]


def group_advantages(rewards: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """[num_groups, n] rewards -> per-sample advantages, normalised within each group.

    A group whose samples all got the same reward teaches nothing: its advantages are 0.
    """
    mean = rewards.mean(axis=1, keepdims=True)
    std = rewards.std(axis=1, keepdims=True)
    return (rewards - mean) / (std + eps)


def clipped_policy_loss(
    new_logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_eps: float
) -> torch.Tensor:
    """PPO's clipped surrogate, averaged over tokens (all tensors [num_tokens])."""
    ratio = torch.exp(new_logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return -torch.minimum(unclipped, clipped).mean()


def response_logprobs(model, sequences: list[tuple[list[int], list[int]]], temperature: float) -> list[torch.Tensor]:
    """log_softmax(logits / T) at each response token, for (prompt ids, response ids) pairs.

    Right-padded into one batch; returns one [len(response)] tensor per pair (with grad).
    """
    device = next(model.parameters()).device
    lengths = [len(p) + len(r) for p, r in sequences]
    width = max(lengths)
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for i, (prompt, response) in enumerate(sequences):
        input_ids[i, : lengths[i]] = torch.tensor(prompt + response, device=device)
        attention_mask[i, : lengths[i]] = 1
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()  # [B, width, vocab]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    out = []
    for i, (prompt, response) in enumerate(sequences):
        # position t predicts token t+1
        rows = logprobs[i, len(prompt) - 1 : len(prompt) - 1 + len(response)]  # [len(response), vocab]
        out.append(rows.gather(1, torch.tensor(response, device=device)[:, None]).squeeze(1))
    return out


def microbatches(items: list, lengths: list[int], tokens_per_microbatch: int) -> list[list]:
    """Consecutive items (sorted by length) whose padded size stays under the budget."""
    order = sorted(range(len(items)), key=lengths.__getitem__)
    batches, current = [], []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > tokens_per_microbatch:
            batches.append(current)
            current = []
        current.append(items[i])
    return batches + [current] if current else batches


def policy_update(model, optimizer, batch: list[dict], config: GRPOConfig) -> float:
    """`config.num_updates` clipped-surrogate gradient steps; returns the first step's loss.

    Each entry of `batch`: prompt/response token ids, old logprobs, advantage.
    """
    batch = [b for b in batch if b["advantage"] != 0.0 and b["response"]]
    if not batch:
        return 0.0
    temperature = config.temperature if config.temperature > 0 else 1.0
    num_tokens = sum(len(b["response"]) for b in batch)
    lengths = [len(b["prompt"]) + len(b["response"]) for b in batch]
    first_loss = None
    model.train()
    for _ in range(config.num_updates):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for micro in microbatches(batch, lengths, config.tokens_per_microbatch):
            new = torch.cat(response_logprobs(model, [(b["prompt"], b["response"]) for b in micro], temperature))
            old = torch.tensor(np.concatenate([b["old_logprobs"] for b in micro]), device=new.device)
            adv = torch.tensor(
                np.concatenate([np.full(len(b["response"]), b["advantage"]) for b in micro]),
                dtype=torch.float32, device=new.device,
            )  # fmt: skip
            # Token-mean over the whole batch: each microbatch adds its share.
            loss = clipped_policy_loss(new, old, adv, config.clip_eps) * (len(new) / num_tokens)
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        optimizer.step()
        first_loss = total if first_loss is None else first_loss
    model.eval()
    return first_loss


def weights_bytes(model) -> bytes:
    """The HF state dict as safetensors bytes (a tied lm_head is the embedding: left out)."""
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return safetensors_bytes({name: t.detach().contiguous().cpu() for name, t in state.items()})


def suffix_match_share(history: dict[str, list[list[int]]], samples: list) -> float:
    """Share of the samples' tokens predicted from their prompt's previous-step responses."""
    predictors, hits, total = {}, 0, 0
    for s in samples:
        if s.prompt_id not in history:
            continue
        if s.prompt_id not in predictors:
            predictors[s.prompt_id] = task.SuffixMatchPredictor(history[s.prompt_id])
        hits += predictors[s.prompt_id].count_hits(s.token_ids)
        total += len(s.token_ids)
    return hits / total if total else float("nan")


def write_traces(path: str, rows: list[dict]) -> None:
    """Writes rollouts in the trace format of services/common/traces.py: one compressed .npz,
    one entry per record for prompt_ids/epoch/sample_index/policy_version/reward, and the
    variable-length arrays concatenated, record i at [offsets[i]:offsets[i+1]]:
    prompt_tokens by prompt_offsets, token_ids and logprobs by token_offsets."""

    def offsets(arrays):
        return np.concatenate([[0], np.cumsum([len(a) for a in arrays])]).astype(np.int64)

    def concat(arrays, dtype):
        return np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.zeros(0, dtype)

    prompts, responses = [r["prompt"] for r in rows], [r["response"] for r in rows]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")  # renamed when whole: a run killed mid-write keeps the previous file
    with open(tmp, "wb") as f:
        np.savez_compressed(
            f,
            prompt_ids=np.array([r["prompt_id"] for r in rows], dtype=np.str_),
            epoch=np.array([r["epoch"] for r in rows], dtype=np.int32),
            sample_index=np.array([r["sample_index"] for r in rows], dtype=np.int32),
            policy_version=np.array([r["policy_version"] for r in rows], dtype=np.int32),
            reward=np.array([r["reward"] for r in rows], dtype=np.float32),
            prompt_offsets=offsets(prompts),
            prompt_tokens=concat(prompts, np.int32),
            token_offsets=offsets(responses),
            token_ids=concat(responses, np.int32),
            logprobs=concat([r["old_logprobs"] for r in rows], np.float32),
        )
    tmp.replace(path)


# What must match for a run to continue another one's state: a different value would make
# the resumed epochs a different experiment from the recorded ones.
RESUME_FIELDS = ("num_prompts", "n", "max_tokens", "temperature", "seed", "lr", "clip_eps", "num_updates",
                 "partial_credit", "task", "train_layers")


def state_path(record: str) -> Path:
    """Where a recording run keeps what it needs to continue: beside its trace file."""
    return Path(f"{record}.state.pt")


class RecordPathError(OSError):
    """The trace file a run records to (or the run's state beside it) cannot be written."""


def prepare_record_path(record: str) -> None:
    """Before the first step (and any weight push): creates the directory of `record` when
    it is missing, and checks that the trace and the run's state beside it can be written
    there (their temporary files are created and removed). RecordPathError, naming the
    path and the reason, otherwise."""
    path = Path(record)
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), record)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = state_path(record)
        for probe in (Path(f"{record}.tmp"), state.with_name(state.name + ".tmp")):
            existed = probe.exists()
            with open(probe, "ab"):
                pass
            if not existed:
                probe.unlink()
    except OSError as err:
        raise RecordPathError(f"record: cannot write the trace file {record!r}: {err}") from err


def save_state(config: "GRPOConfig", model, optimizer, step: int, version: int, trace_rows: list[dict],
               stats: list[dict], history: dict, run_id: str | None = None) -> None:
    """After step `step`: the trained parameters, the optimizer, the trace and the counters,
    written to a temporary file and renamed (a run killed mid-write keeps the previous state)."""
    path = state_path(config.record)
    path.parent.mkdir(parents=True, exist_ok=True)
    params = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    state = dict(next_step=step + 1, version=version, params=params, optimizer=optimizer.state_dict(),
                 trace_rows=trace_rows, stats=stats, history=history, run_id=run_id,
                 config={f: getattr(config, f) for f in RESUME_FIELDS})
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def load_state(config: "GRPOConfig", model, optimizer) -> dict | None:
    """The saved state of an earlier run of this recording, loaded into `model` and
    `optimizer`; None when there is none. ValueError naming the field when the saved run
    was a different experiment."""
    path = state_path(config.record)
    if not path.exists():
        return None
    state = torch.load(path, weights_only=False)
    for field, saved in state["config"].items():
        if getattr(config, field) != saved:
            raise ValueError(f"resume: {field} is {getattr(config, field)!r}, the recorded run used {saved!r} "
                             f"({path})")
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if set(state["params"]) != trained:
        raise ValueError(f"resume: the saved parameters are not the ones this run trains ({path})")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in trained:
                p.copy_(state["params"][name])
    optimizer.load_state_dict(state["optimizer"])
    return state


def step_advantages(by_prompt: dict[str, list], rewards: dict[tuple[str, int], float]) -> dict[tuple[str, int], float]:
    """Group-normalised advantage per (prompt id, sample index); aborted samples get 0."""
    advantages = {s.key: 0.0 for group in by_prompt.values() for s in group}
    for group in by_prompt.values():
        group = [s for s in group if s.finish_reason != "abort"]
        if group:
            normalised = group_advantages(np.array([[rewards[s.key] for s in group]]))[0]
            advantages.update((s.key, float(a)) for s, a in zip(group, normalised))
    return advantages


def step_stats(step: int, result, rewards: dict, history_match: float, loss: float, update_s: float, version: int):
    """One step's numbers: the trainer's own, and the service's from the step summary."""
    summary, samples = result.summary, result.samples
    return {
        "step": step,
        "reward": float(np.mean(list(rewards.values()))) if rewards else 0.0,
        "mean_length": float(np.mean([len(s.token_ids) for s in samples])) if samples else 0.0,
        "history_match": history_match,
        "acceptance_rate": summary.acceptance_rate if summary else float("nan"),
        "num_draft_tokens": summary.num_draft_tokens if summary else 0,
        "num_accepted_tokens": summary.num_accepted_tokens if summary else 0,
        "num_verify_steps": summary.num_verify_steps if summary else 0,
        "num_generated_tokens": summary.num_generated_tokens if summary else 0,
        "history_hit_rate": summary.history_hit_rate if summary else float("nan"),
        "makespan_s": summary.makespan_s if summary else float("nan"),
        "loss": loss,
        "update_s": update_s,
        "version": version,
    }


def format_stats(row: dict) -> str:
    return (
        f"step {row['step']}: reward {row['reward']:.3f}  mean len {row['mean_length']:.0f}  "
        f"history match {_pct(row['history_match'])}  "
        f"accept {_pct(row['acceptance_rate'])} of {row['num_draft_tokens']} draft tokens  "
        f"history hits {_pct(row['history_hit_rate'])}  rollout {row['makespan_s']:.2f}s  "
        f"update {row['update_s']:.2f}s  loss {row['loss']:+.4f}  -> v{row['version']}"
    )


def run(
    client, model_dir: str, config: GRPOConfig | None = None, *, version: int | None = None, log=print,
    **overrides
) -> list[dict]:
    """Runs `config.steps` GRPO steps against `client` (a rhymerl.RolloutClient, or anything
    with its rollout/report_rewards/push_weights methods, and `stats` when it has one);
    returns one stats dict per step.

    Args:
        config: defaults to GRPOConfig(); keyword `overrides` replace its fields
            (e.g. run(client, "models/tiny", steps=4, num_prompts=8)).
        version: None (the default): asked of the service (`client.stats().policy_version`).
            Version 0 is the checkpoint the service started with, `model_dir`'s; a higher
            one is another policy (an earlier run's), so this run pushes its starting
            weights first, as the next version. An int: the version under which the
            service serves `model_dir`'s checkpoint now (nothing is pushed first). Every
            step then pushes version + 1.
        log: called with one line at the start (the run id, the version) and one per step.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = dataclasses.replace(config or GRPOConfig(), **overrides)
    if config.task not in TASKS:
        raise ValueError(f"task: unknown {config.task!r}, expected one of {sorted(TASKS)}")
    problem_set = TASKS[config.task]
    if config.record:
        prepare_record_path(config.record)  # a bad path fails here, not after a step's push

    torch.manual_seed(config.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(config.device).eval()
    optimizer = torch.optim.AdamW(trainable_parameters(model, config.train_layers), lr=config.lr, betas=(0.9, 0.99),
                                  weight_decay=0.0)
    problems = problem_set.make_prompts(config.num_prompts, config.seed)
    by_id = {p.prompt_id: p for p in problems}
    prompts = encode_prompts(tokenizer, problems)
    prompt_tokens = {p.prompt_id: p.token_ids for p in prompts}
    history: dict[str, list[list[int]]] = {}
    trace_rows, stats = [], []
    first_step = 0
    state = None
    if config.resume:
        if not config.record:
            raise ValueError("resume: needs record (the run's state is kept beside its trace file)")
        state = load_state(config, model, optimizer)
    run_id = config.run_id or new_run_id()
    serving = serving_version(client) if version is None else version
    if state is not None:
        recorded_id = state.get("run_id")
        if config.run_id and recorded_id and config.run_id != recorded_id:
            raise ValueError(f"resume: run_id is {config.run_id!r}, the recorded run used {recorded_id!r}")
        run_id = recorded_id or run_id
        first_step, trace_rows, stats, history = (state["next_step"], state["trace_rows"], state["stats"],
                                                  state["history"])
        # The service gets the policy the run had reached: under its recorded version when
        # that is not below the one serving (a fresh service serves 0; one that still serves
        # the recorded version with these bytes acknowledges it), else as the next one.
        target = state["version"] if serving <= state["version"] else serving + 1
        version = client.push_weights(target, weights_bytes(model))
        log(f"run {run_id}: resumed {config.record} after step {first_step - 1}: policy version {version} pushed")
    elif version is None and serving > 0:
        # Not model_dir's checkpoint (an earlier run's policy): sample this trainer's own first.
        version = client.push_weights(serving + 1, weights_bytes(model))
        log(f"run {run_id}: the service served policy version {serving}, another policy than {model_dir}: "
            f"pushed the trainer's as version {version}")
    else:
        version = serving
        log(f"run {run_id}: starting at policy version {version}")
    for step in range(first_step, config.steps):
        # 1. rollout
        step_id = step_id_of(run_id, step, version)
        sampling = SamplingParams(
            temperature=config.temperature,
            max_tokens=config.max_tokens,
            stop_token_ids=(tokenizer.eos_token_id,),
            seed=config.seed * 1_000_003 + step,
        )
        result = client.rollout(step_id, prompts, config.n, sampling, policy_version=version)
        samples = result.samples
        # 2. rewards
        rewards = {
            s.key: problem_set.reward(by_id[s.prompt_id], tokenizer.decode(s.token_ids, skip_special_tokens=True),
                                      config.partial_credit)
            for s in samples
        }  # fmt: skip
        client.report_rewards(step_id, [(pid, index, r) for (pid, index), r in rewards.items()])
        # 3. group-relative advantages
        advantages = step_advantages(result.by_prompt, rewards)
        batch = [
            {
                "prompt_id": s.prompt_id, "epoch": step, "sample_index": s.sample_index,
                "policy_version": s.policy_version, "reward": rewards[s.key], "advantage": advantages[s.key],
                "prompt": prompt_tokens[s.prompt_id], "response": list(s.token_ids),
                "old_logprobs": np.asarray(s.logprobs, dtype=np.float32),
            }
            for s in samples
        ]  # fmt: skip
        # 4. policy update
        update_start = time.perf_counter()
        loss = policy_update(model, optimizer, batch, config)
        update_s = time.perf_counter() - update_start
        # 5. weights to the service
        version = client.push_weights(version + 1, weights_bytes(model))

        row = step_stats(step, result, rewards, suffix_match_share(history, samples), loss, update_s, version)
        stats.append(row)
        log(format_stats(row))
        history = {}
        for s in samples:
            history.setdefault(s.prompt_id, []).append(list(s.token_ids))
        if config.record:
            trace_rows.extend(batch)
            write_traces(config.record, trace_rows)
            save_state(config, model, optimizer, step, version, trace_rows, stats, history, run_id)
    return stats


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, GRPOConfig]:
    d = GRPOConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="localhost:50051", help="the rhymerl scheduler")
    parser.add_argument("--model-dir", required=True, help="HF checkpoint the service also serves (version 0)")
    parser.add_argument("--steps", "--epochs", dest="steps", type=int, default=d.steps,
                        help="RL epochs; each samples every prompt")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=d.num_prompts, help="size of the fixed prompt set")
    parser.add_argument("--n", type=int, default=d.n, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--lr", type=float, default=d.lr)
    parser.add_argument("--updates", type=int, default=d.num_updates, help="gradient steps per RL step")
    parser.add_argument("--partial-credit", type=float, default=d.partial_credit)
    parser.add_argument("--record", help="write every rollout to this trace file (.npz)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the --record run from its last finished step (its state is kept beside "
                             "the trace file as <record>.state.pt), under its recorded run id")
    parser.add_argument("--run-id",
                        help="names this run's step ids (grpo-RUN_ID-stepK-vVERSION); default: a fresh one per "
                             "run. Giving an earlier run's id again rejoins the steps it submitted at the same "
                             "policy version (their samples come back instead of new ones): how a restarted "
                             "trainer picks up a step it had started")
    parser.add_argument("--task", choices=sorted(TASKS), default=d.task, help="the problems and their reward")
    parser.add_argument("--train-layers", type=int, default=d.train_layers,
                        help="0: train every parameter; k: only the last k decoder layers and the final norm")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per service call")
    args = parser.parse_args(argv)
    config = GRPOConfig(
        steps=args.steps, num_prompts=args.prompts, n=args.n, max_tokens=args.max_tokens,
        temperature=args.temperature, seed=args.seed, lr=args.lr, num_updates=args.updates,
        partial_credit=args.partial_credit, record=args.record, resume=args.resume, task=args.task,
        train_layers=args.train_layers, run_id=args.run_id,
    )  # fmt: skip
    return args, config


def main(argv: list[str] | None = None) -> list[dict]:
    """The command line; returns run's stats rows (one per step)."""
    from rhymerl import RolloutClient

    args, config = parse_args(argv)
    client = RolloutClient(args.address, timeout_s=args.timeout)  # rides through a scheduler restart (retry_window_s)
    try:
        return run(client, args.model_dir, config)
    except RecordPathError as err:  # raised before the first step: one line, no traceback
        raise SystemExit(f"grpo_trainer.py: error: --{err}") from None
    finally:
        client.close()


if __name__ == "__main__":
    main()
