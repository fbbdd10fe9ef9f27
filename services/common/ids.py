"""Identities derived from content: prompt ids and per-sample seeds."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence


def prompt_id_from_tokens(token_ids: Sequence[int]) -> str:
    """A stable id for a prompt the trainer did not name (blake2b of its int32 tokens)."""
    ids = array("i", token_ids)  # int32 (4 bytes: checked below), no numpy in the scheduler
    if sys.byteorder != "little":
        ids.byteswap()
    data = ids.tobytes()
    return "h" + hashlib.blake2b(data, digest_size=12).hexdigest()


def sample_seed(step_seed: int | None, step_id: str, prompt_id: str, sample_index: int) -> int:
    """The seed of one sample, never fixed by placement.

    With a step seed: from (step seed, prompt, index), so every step that passes the
    same seed draws the same noise for a prompt (what a user who sets a seed asks for).
    Without: from (step id, prompt, index), so each step draws fresh noise, and a step
    re-submitted under its id (a trainer's retry) gets the same samples back.

    Returned as a non-negative int63 so it fits int64 tensors and proto uint64.
    """
    h = hashlib.blake2b(_seed_prefix(step_seed, step_id, prompt_id) + b"%d" % sample_index, digest_size=8)
    return int.from_bytes(h.digest(), "little") & _INT63


def sample_seeds(step_seed: int | None, step_id: str, prompt_id: str, n: int) -> list[int]:
    """``sample_seed`` of samples 0..n-1 of a prompt (its key's prefix hashed once)."""
    base = hashlib.blake2b(_seed_prefix(step_seed, step_id, prompt_id), digest_size=8)
    seeds = []
    for k in range(n):
        h = base.copy()
        h.update(b"%d" % k)
        seeds.append(int.from_bytes(h.digest(), "little") & _INT63)
    return seeds


_INT63 = (1 << 63) - 1


def _seed_prefix(step_seed: int | None, step_id: str, prompt_id: str) -> bytes:
    # The key spaces cannot collide: a seed is a bare integer, a step id is tagged. A step id
    # without ":" ends at the first ":" (the key every release has made). One with ":" goes
    # with its length, under a tag of its own: ("run:1", "p") and ("run", "1:p") were one key,
    # the same noise for two steps' samples. A prompt id runs to the last ":" (the sample
    # index after it has none).
    if step_seed is not None:
        key = f"{step_seed}:{prompt_id}:"
    elif ":" in step_id:
        key = f"step/{len(step_id)}:{step_id}:{prompt_id}:"
    else:
        key = f"step={step_id}:{prompt_id}:"
    return key.encode()
