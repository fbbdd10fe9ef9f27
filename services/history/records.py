"""What the history service stores and returns: a rollout, a reward, and an epoch (one
step's rollouts of one prompt), and how an epoch is unpacked from the store's reply."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np


class Rollout(NamedTuple):
    prompt_id: str
    step_id: str
    sample_index: int
    policy_version: int
    token_ids: Sequence[int] | np.ndarray


class Reward(NamedTuple):
    prompt_id: str
    step_id: str
    sample_index: int
    reward: float


@dataclass
class Epoch:
    """One step's rollouts of one prompt (``responses`` are read-only views of the reply)."""

    step_id: str
    policy_version: int
    sample_indices: np.ndarray  # [num_samples] int32, ascending
    lengths: np.ndarray  # [num_samples] int32
    rewards: np.ndarray  # [num_samples] float32, NaN where none was reported
    responses: list[np.ndarray]  # num_samples x [length] int32; [] when read without tokens


def epoch_from_reply(reply: list) -> Epoch:
    step_id, version, packed_lengths, packed_rewards, packed_tokens = reply  # see scripts.GET_HISTORY
    pairs = np.frombuffer(packed_lengths, dtype="<i4").reshape(-1, 2)  # [num_samples, (sample_index, length)]
    order = np.argsort(pairs[:, 0], kind="stable")
    return Epoch(
        step_id=step_id.decode(),
        policy_version=int(version),
        sample_indices=pairs[order, 0],
        lengths=pairs[order, 1],
        rewards=np.frombuffer(packed_rewards, dtype="<f4")[order],
        responses=[np.frombuffer(packed_tokens[n], dtype="<i4") for n in order] if packed_tokens else [],
    )
