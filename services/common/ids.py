"""Identities derived from content: prompt ids and per-sample seeds."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def prompt_id_from_tokens(token_ids: Sequence[int]) -> str:
    """A stable id for a prompt the trainer did not name (blake2b of its int32 tokens)."""
    data = np.asarray(token_ids, dtype="<i4").tobytes()
    return "h" + hashlib.blake2b(data, digest_size=12).hexdigest()


def sample_seed(step_seed: int, prompt_id: str, sample_index: int) -> int:
    """The seed of one sample: fixed by (step seed, prompt, index), never by placement.

    Returned as a non-negative int63 so it fits int64 tensors and proto uint64.
    """
    h = hashlib.blake2b(f"{step_seed}:{prompt_id}:{sample_index}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)

