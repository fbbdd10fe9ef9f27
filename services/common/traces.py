"""Recorded rollouts ("traces"): every sampled response of a multi-epoch RL run.

On disk, one compressed .npz (`numpy.savez_compressed`) with one row per record:

    prompt_ids       str   [num_records]      the prompt's id
    epoch            int32 [num_records]      the RL epoch (the step that sampled it)
    sample_index     int32 [num_records]      index within the prompt's group
    policy_version   int32 [num_records]      weights version that sampled it
    reward           float32 [num_records]
    prompt_offsets   int64 [num_records + 1]  record i's prompt tokens are
    prompt_tokens    int32 [total]              prompt_tokens[prompt_offsets[i]:prompt_offsets[i+1]]
    token_offsets    int64 [num_records + 1]  record i's response tokens and logprobs are
    token_ids        int32 [total]              token_ids[token_offsets[i]:token_offsets[i+1]]
    logprobs         float32 [total]            (same slice)

Nothing else: the example GRPO trainer (clients/python/examples/grpo_trainer.py) writes
this format with its own few lines of numpy, without importing this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class TraceRecord:
    prompt_id: str
    epoch: int
    sample_index: int
    policy_version: int
    prompt_token_ids: np.ndarray  # [num_prompt_tokens] int32
    token_ids: np.ndarray  # [num_tokens] int32, the response
    logprobs: np.ndarray  # [num_tokens] float32, sampling logprob of each response token
    reward: float


def _offsets(arrays: list[np.ndarray]) -> np.ndarray:
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    return offsets


def _concat(arrays: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]) if arrays else np.zeros(0, dtype)


def write_traces(path: str | Path, records: list[TraceRecord]) -> None:
    """Writes `records` to the .npz file `path` (in this order).

    Raises:
        ValueError: a record whose token_ids and logprobs differ in length.
    """
    for r in records:
        if len(r.token_ids) != len(r.logprobs):
            raise ValueError(
                f"record {r.prompt_id}/{r.epoch}/{r.sample_index}: "
                f"{len(r.token_ids)} tokens but {len(r.logprobs)} logprobs"
            )
    prompts = [r.prompt_token_ids for r in records]
    responses = [r.token_ids for r in records]
    with open(path, "wb") as f:  # an open file: savez would otherwise append ".npz"
        np.savez_compressed(
            f,
            prompt_ids=np.array([r.prompt_id for r in records], dtype=np.str_),
            epoch=np.array([r.epoch for r in records], dtype=np.int32),
            sample_index=np.array([r.sample_index for r in records], dtype=np.int32),
            policy_version=np.array([r.policy_version for r in records], dtype=np.int32),
            reward=np.array([r.reward for r in records], dtype=np.float32),
            prompt_offsets=_offsets(prompts),
            prompt_tokens=_concat(prompts, np.int32),
            token_offsets=_offsets(responses),
            token_ids=_concat(responses, np.int32),
            logprobs=_concat([r.logprobs for r in records], np.float32),
        )


def read_traces(path: str | Path) -> list[TraceRecord]:
    """The records of the .npz file `path`, in the order they were written."""
    with np.load(path, allow_pickle=False) as data:
        d = {name: data[name] for name in data.files}
    po, to = d["prompt_offsets"], d["token_offsets"]
    return [
        TraceRecord(
            prompt_id=str(d["prompt_ids"][i]),
            epoch=int(d["epoch"][i]),
            sample_index=int(d["sample_index"][i]),
            policy_version=int(d["policy_version"][i]),
            prompt_token_ids=d["prompt_tokens"][po[i] : po[i + 1]],
            token_ids=d["token_ids"][to[i] : to[i + 1]],
            logprobs=d["logprobs"][to[i] : to[i + 1]],
            reward=float(d["reward"][i]),
        )
        for i in range(len(d["epoch"]))
    ]
