"""Checks of client input; each failure names the offending field."""

from __future__ import annotations

import math

from rhymerl.v1 import common_pb2

from services.common.errors import InvalidArgument

MAX_N = 4096


def check_sampling(p: common_pb2.SamplingParams, field: str = "sampling", vocab_size: int = 0) -> None:
    """Raises InvalidArgument for out-of-range sampling parameters."""
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidArgument(f"must be a finite number >= 0, got {p.temperature}", f"{field}.temperature")
    if not 0.0 <= p.top_p <= 1.0:
        raise InvalidArgument(f"must be in [0, 1], got {p.top_p}", f"{field}.top_p")
    if p.top_k < 0:
        raise InvalidArgument(f"must be >= 0, got {p.top_k}", f"{field}.top_k")
    if not 0.0 <= p.min_p <= 1.0:
        raise InvalidArgument(f"must be in [0, 1], got {p.min_p}", f"{field}.min_p")
    if p.max_tokens < 1:
        raise InvalidArgument(f"must be >= 1, got {p.max_tokens}", f"{field}.max_tokens")
    if p.min_tokens < 0 or p.min_tokens > p.max_tokens:
        raise InvalidArgument(f"must be in [0, max_tokens], got {p.min_tokens}", f"{field}.min_tokens")
    if p.logprobs_mode not in common_pb2.LogprobsMode.values():
        raise InvalidArgument(f"unknown LogprobsMode {p.logprobs_mode}", f"{field}.logprobs_mode")
    check_token_ids(p.stop_token_ids, f"{field}.stop_token_ids", vocab_size, allow_empty=True)


def check_token_ids(ids, field: str, vocab_size: int = 0, allow_empty: bool = False) -> None:
    """Token ids must be non-empty (unless allowed) and in [0, vocab_size)."""
    if not ids and not allow_empty:
        raise InvalidArgument("must be non-empty", field)
    if not ids:
        return
    lo, hi = min(ids), max(ids)
    if lo < 0:
        raise InvalidArgument(f"token id {lo} is negative", field)
    if vocab_size and hi >= vocab_size:
        raise InvalidArgument(f"token id {hi} is out of range [0, {vocab_size})", field)
