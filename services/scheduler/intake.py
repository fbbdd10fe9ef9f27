"""Step intake: a trainer's request checked once, and a step split into one request per
(prompt, sample). Every error names its field; every size a client controls is bounded.
Knows no gRPC and nothing of placement.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from rhymerl.v1 import rollout_pb2

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.ids import prompt_id_from_tokens, sample_seeds
from services.common.packed import varint
from services.common.validation import MAX_N, check_id, check_length, check_sampling, check_token_ids
from services.scheduler.policies.base import Request
from services.scheduler.step import SampleProgress
from services.scheduler.worker_link import prompt_field

@dataclass(frozen=True)
class Fleet:
    """What every registered worker can serve (0: unknown, not checked)."""

    vocab_size: int
    max_model_len: int


def check_step(req: rollout_pb2.SubmitStepRequest, serving_version: int) -> None:
    """The checks that need no worker (done before a re-submission is matched)."""
    check_id(req.step_id, "step_id")
    if not req.prompts:
        raise InvalidArgument("must be non-empty", "prompts")
    if not 1 <= req.n <= MAX_N:
        raise InvalidArgument(f"must be in [1, {MAX_N}], got {req.n}", "n")
    if req.policy_version < 0:
        raise InvalidArgument(f"must be >= 0, got {req.policy_version}", "policy_version")
    if req.policy_version > serving_version:
        raise FailedPrecondition(
            f"version {req.policy_version} is not serving yet (serving {serving_version}); push it first",
            "policy_version")


def split(req: rollout_pb2.SubmitStepRequest, fleet: Fleet) -> Iterator[list[SampleProgress]]:
    """Per prompt, one SampleProgress per sample, each with its own seed (``sample_seed``:
    from the step's seed, or without one its id, the prompt id and the sample index;
    never from placement). A generator, so the caller can let other work in between the
    prompts of a huge step."""
    check_sampling(req.sampling, "sampling", fleet.vocab_size)
    max_len, max_tokens = fleet.max_model_len, req.sampling.max_tokens
    step_seed = req.sampling.seed if req.sampling.HasField("seed") else None
    step_id = req.step_id  # one str shared by every sample (each read of the field makes a new one)
    seen = set()
    for i, prompt in enumerate(req.prompts):
        field = f"prompts[{i}]"
        check_token_ids(prompt.token_ids, f"{field}.token_ids", fleet.vocab_size)
        check_length(len(prompt.token_ids), max_tokens, max_len, f"{field}.token_ids", "sampling.max_tokens")
        if prompt.prompt_id:
            check_id(prompt.prompt_id, f"{field}.prompt_id")
        pid = prompt.prompt_id or prompt_id_from_tokens(prompt.token_ids)
        if pid in seen:
            raise InvalidArgument(f"duplicate prompt_id {pid!r}", f"{field}.prompt_id")
        seen.add(pid)
        encoded = prompt_field(pid, prompt.token_ids)  # once per prompt; its samples share it
        num_tokens = len(prompt.token_ids)
        yield [SampleProgress(Request(step_id, pid, k, num_tokens, max_tokens), encoded, varint(seed))
               for k, seed in enumerate(sample_seeds(step_seed, step_id, pid, req.n))]


def check_report_size(num_rewards: int, num_samples: int) -> None:
    """Each sample is reported at most once: more rewards than the step has samples is
    INVALID_ARGUMENT naming ``rewards``, whatever the rewards are."""
    if num_rewards > num_samples:
        raise InvalidArgument(f"{num_rewards} rewards for a step of {num_samples} samples (each sample at most "
                              "once)", "rewards")


def check_rewards(req: rollout_pb2.ReportRewardsRequest) -> None:
    """Rewards must name a sample, each once, and be numbers: NaN is history's "no reward" marker."""
    check_id(req.step_id, "step_id")
    seen = set()
    for i, reward in enumerate(req.rewards):
        field = f"rewards[{i}]"
        check_id(reward.prompt_id, f"{field}.prompt_id")
        if reward.sample_index < 0:
            raise InvalidArgument(f"must be >= 0, got {reward.sample_index}", f"{field}.sample_index")
        key = (reward.prompt_id, reward.sample_index)
        if key in seen:  # which one would count? (ReportLogprobs refuses the same)
            raise InvalidArgument(f"sample {key} is reported twice", field)
        seen.add(key)
        if not math.isfinite(reward.reward):
            raise InvalidArgument(f"must be a finite number, got {reward.reward}", f"{field}.reward")
