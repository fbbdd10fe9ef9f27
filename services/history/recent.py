"""The last stored responses to any prompt, for the rollout workers' global draft index.

A worker sees only the prompts it serves; its drafter also learns from other prompts'
responses (they share phrasing within a task family). This capped Redis list keeps the
newest `max_entries` responses of all prompts, newest first, each packed as

    uint16 len(prompt_id) | prompt_id | uint16 len(step_id) | step_id | int32 sample_index
    | int32 token ids ... (all little-endian)

One LPUSH + LTRIM + EXPIRE per write, one LRANGE per read (one round trip each).
This module knows nothing about gRPC.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.errors import InvalidArgument, Unavailable
from services.history.keys import HistoryKeys

MAX_RESPONSES = 4096  # per read
MAX_TOKENS = 1 << 22  # per read


class RecentResponse(NamedTuple):
    prompt_id: str
    step_id: str
    sample_index: int
    token_ids: np.ndarray  # [num_tokens] int32, read-only


def pack(prompt_id: str, step_id: str, sample_index: int, token_ids) -> bytes:
    pid, sid = prompt_id.encode(), step_id.encode()
    return (struct.pack("<H", len(pid)) + pid + struct.pack("<H", len(sid)) + sid
            + struct.pack("<i", sample_index) + np.asarray(token_ids, dtype="<i4").tobytes())


def unpack(entry: bytes) -> RecentResponse:
    (n,) = struct.unpack_from("<H", entry, 0)
    prompt_id = entry[2:2 + n].decode()
    at = 2 + n
    (m,) = struct.unpack_from("<H", entry, at)
    step_id = entry[at + 2:at + 2 + m].decode()
    at += 2 + m
    (sample_index,) = struct.unpack_from("<i", entry, at)
    return RecentResponse(prompt_id, step_id, sample_index, np.frombuffer(entry, dtype="<i4", offset=at + 4))


class RecentResponses:
    """The capped list of recent responses (see the module docstring).

    Args:
        client: the history store's ``redis.asyncio.Redis``.
        keys: key names and TTL.
        max_entries: responses kept; older ones are trimmed on every write.
    """

    def __init__(self, client: aioredis.Redis, keys: HistoryKeys, max_entries: int = MAX_RESPONSES):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.client = client
        self.keys = keys
        self.max_entries = max_entries

    async def push(self, entries: Sequence[bytes]) -> None:
        """Adds packed responses (`pack`) as the newest, in order."""
        if not entries:
            return
        key = self.keys.recent()
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(key, *entries)
        pipe.ltrim(key, 0, self.max_entries - 1)
        pipe.expire(key, self.keys.ttl_seconds)
        try:
            await pipe.execute()
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise Unavailable(f"redis is unreachable: {exc}") from exc

    async def read(self, max_responses: int, max_tokens: int) -> list[RecentResponse]:
        """The newest responses, at most `max_responses` and `max_tokens` tokens in all.

        Raises:
            InvalidArgument: a limit out of its range.
        """
        if not 1 <= max_responses <= MAX_RESPONSES:
            raise InvalidArgument(f"must be in [1, {MAX_RESPONSES}], got {max_responses}", field="max_responses")
        if not 1 <= max_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"must be in [1, {MAX_TOKENS}], got {max_tokens}", field="max_tokens")
        try:
            entries = await self.client.lrange(self.keys.recent(), 0, max_responses - 1)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise Unavailable(f"redis is unreachable: {exc}") from exc
        out, num_tokens = [], 0
        for entry in entries:
            response = unpack(entry)
            num_tokens += len(response.token_ids)
            if num_tokens > max_tokens:
                break
            out.append(response)
        return out
