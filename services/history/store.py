"""HistoryStore: the last K epochs of rollouts per prompt, kept in Redis.

Each public call costs one Redis round trip however many prompts it covers:
one Lua script call per prompt, all of them sent in one pipeline. Lua is what
makes one round trip possible: a read must first learn a prompt's epoch list
before it can fetch the epochs, and a write must check, append and evict
atomically; both happen inside the script, next to the data. The key layout
is in keys.py. This module knows nothing about gRPC.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

import numpy as np
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable
from services.history.keys import HistoryKeys


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


# Sets the TTL of the prompt's epoch list and of every epoch it keeps.
_REFRESH_TTL = """
local function refresh_ttl(epochs, stem, ttl)
  redis.call('EXPIRE', epochs, ttl)
  for _, step in ipairs(redis.call('ZRANGE', epochs, 0, -1)) do
    redis.call('EXPIRE', stem .. step, ttl)
  end
end
"""

# KEYS: epochs zset, then one epoch hash per step group.
# ARGV: stem, K, ttl, then per step group: step_id, policy_version, num_samples,
#       and num_samples pairs (sample_index, packed tokens).
# Returns the number of samples newly stored.
_PUT_ROLLOUTS = _REFRESH_TTL + """
local epochs, stem = KEYS[1], ARGV[1]
local num_epochs, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local num_written, a = 0, 4
for g = 2, #KEYS do
  local key, step, version, num_samples = KEYS[g], ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  a = a + 3
  if not redis.call('ZSCORE', epochs, step) then
    local newest = redis.call('ZRANGE', epochs, -1, -1, 'WITHSCORES')
    redis.call('ZADD', epochs, newest[2] and tonumber(newest[2]) + 1 or 1, step)
  end
  redis.call('HSETNX', key, 'version', version)
  local new_lengths = {}
  for _ = 1, num_samples do
    local i, tokens = ARGV[a], ARGV[a + 1]
    a = a + 2
    if redis.call('HSETNX', key, 'tok:' .. i, tokens) == 1 then
      new_lengths[#new_lengths + 1] = struct.pack('<i4i4', tonumber(i), math.floor(#tokens / 4))
    end
  end
  if #new_lengths > 0 then
    local lengths = redis.call('HGET', key, 'lengths') or ''
    redis.call('HSET', key, 'lengths', lengths .. table.concat(new_lengths))
    num_written = num_written + #new_lengths
  end
end
local num_evicted = redis.call('ZCARD', epochs) - num_epochs
if num_evicted > 0 then
  for _, step in ipairs(redis.call('ZRANGE', epochs, 0, num_evicted - 1)) do
    redis.call('DEL', stem .. step)
  end
  redis.call('ZREMRANGEBYRANK', epochs, 0, num_evicted - 1)
end
refresh_ttl(epochs, stem, ttl)
return num_written
"""

# KEYS: epochs zset, then the epoch hash of each reward.
# ARGV: stem, ttl, then per reward: sample_index, packed float32.
# Returns the number of rewards newly stored. A reward may arrive before its
# rollout; it then waits in the epoch hash (with the TTL) for the rollout.
_PUT_REWARDS = _REFRESH_TTL + """
local stem, ttl = ARGV[1], tonumber(ARGV[2])
local num_written = 0
for r = 2, #KEYS do
  num_written = num_written + redis.call('HSET', KEYS[r], 'rew:' .. ARGV[2 * r - 1], ARGV[2 * r])
  redis.call('EXPIRE', KEYS[r], ttl)
end
refresh_ttl(KEYS[1], stem, ttl)
return num_written
"""

# KEYS: epochs zset. ARGV: stem, max_epochs (0 = all), include_tokens ('1'/'0').
# Returns, newest epoch first: {step_id, version, packed (index, length) pairs,
# packed float32 rewards (NaN where missing), per-sample packed tokens (empty
# unless include_tokens)}, samples in the order of the pairs. Tokens stay one
# bulk string per sample: concatenating them in Lua costs Redis twice the time.
# The epoch keys are not in KEYS because they are only known here; they share
# the prompt's hash tag, hence its cluster slot.
_GET_HISTORY = """
local NAN = '\\0\\0\\192\\127'  -- float32 quiet NaN, little-endian
local function hmget(key, fields)  -- unpack() is bounded by the Lua C stack: chunk
  local values = {}
  for first = 1, #fields, 1024 do
    for _, v in ipairs(redis.call('HMGET', key, unpack(fields, first, math.min(first + 1023, #fields)))) do
      values[#values + 1] = v
    end
  end
  return values
end
local stem, max_epochs, with_tokens = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local out = {}
for _, step in ipairs(redis.call('ZRANGE', KEYS[1], 0, max_epochs - 1, 'REV')) do
  local key = stem .. step
  local meta = redis.call('HMGET', key, 'version', 'lengths')
  if meta[1] and meta[2] then
    local reward_fields, token_fields = {}, {}
    for p = 1, #meta[2], 8 do
      local i = struct.unpack('<i4', meta[2], p)
      reward_fields[#reward_fields + 1] = 'rew:' .. i
      token_fields[#token_fields + 1] = 'tok:' .. i
    end
    local rewards = hmget(key, reward_fields)
    for n = 1, #rewards do
      rewards[n] = rewards[n] or NAN
    end
    local tokens = with_tokens and hmget(key, token_fields) or {}
    out[#out + 1] = {step, meta[1], meta[2], table.concat(rewards), tokens}
  end
end
return out
"""


class _Script:
    def __init__(self, text: str):
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()


class HistoryStore:
    """Stores and reads rollouts per prompt; see keys.py for the layout.

    Args:
        client: a ``redis.asyncio.Redis`` with ``decode_responses=False``.
        keys: key names and TTL.
        num_epochs: K, the epochs kept per prompt (older ones are deleted).
        where: how to name the Redis in error messages (no credentials).
    """

    def __init__(self, client: aioredis.Redis, keys: HistoryKeys, num_epochs: int, where: str = "redis"):
        if num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1, got {num_epochs}")
        self.client = client
        self.keys = keys
        self.num_epochs = num_epochs
        self.where = where
        self._put_rollouts = _Script(_PUT_ROLLOUTS)
        self._put_rewards = _Script(_PUT_REWARDS)
        self._get_history = _Script(_GET_HISTORY)

    @classmethod
    def from_url(cls, url: str, keys: HistoryKeys, num_epochs: int, timeout_s: float = 5.0) -> "HistoryStore":
        """A store on ``url``; a Redis that does not answer within ``timeout_s`` fails the call."""
        client = aioredis.Redis.from_url(
            url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=1))
        parts = urlsplit(url)
        where = f"{parts.hostname}:{parts.port or 6379}" if parts.hostname else parts.path
        return cls(client, keys, num_epochs, where=f"redis at {where}")

    async def ping(self) -> None:
        await self._guarded(self.client.ping())

    async def close(self) -> None:
        await self.client.aclose()

    async def put_rollouts(self, rollouts: Sequence[Rollout]) -> int:
        """Stores rollouts; returns how many were new (re-sent ones are skipped).

        A step not yet kept for a prompt becomes its newest epoch, and the
        oldest beyond K are deleted. So a sample that arrives after its epoch
        was evicted starts a new epoch: harmless, as the scheduler writes a
        step's samples long before K newer steps of the same prompt exist.

        Raises:
            InvalidArgument: a rollout has an empty id or a negative sample index.
            Unavailable: Redis cannot be reached.
        """
        groups: dict[str, dict[str, tuple[int, list]]] = {}  # prompt -> step -> (version, [index, tokens]*)
        for n, r in enumerate(rollouts):
            _check_ids(f"rollouts[{n}]", r.prompt_id, r.step_id, r.sample_index)
            steps = groups.setdefault(r.prompt_id, {})
            _, samples = steps.setdefault(r.step_id, (int(r.policy_version), []))
            samples += [int(r.sample_index), np.asarray(r.token_ids, dtype="<i4").tobytes()]
        calls = []
        for prompt_id, steps in groups.items():
            stem = self.keys.epoch_stem(prompt_id)
            keys = [self.keys.epochs(prompt_id)] + [stem + step for step in steps]
            args = [stem, self.num_epochs, self.keys.ttl_seconds]
            for step, (version, samples) in steps.items():
                args += [step, version, len(samples) // 2, *samples]
            calls.append((keys, args))
        return sum(await self._run(self._put_rollouts, calls))

    async def put_rewards(self, rewards: Sequence[Reward]) -> int:
        """Stores rewards beside their rollouts; returns how many were new."""
        groups: dict[str, tuple[list, list]] = {}  # prompt -> (epoch keys, [index, packed reward]*)
        for n, r in enumerate(rewards):
            _check_ids(f"rewards[{n}]", r.prompt_id, r.step_id, r.sample_index)
            keys, args = groups.setdefault(r.prompt_id, ([], []))
            keys.append(self.keys.epoch(r.prompt_id, r.step_id))
            args += [int(r.sample_index), struct.pack("<f", r.reward)]
        calls = [([self.keys.epochs(p), *keys], [self.keys.epoch_stem(p), self.keys.ttl_seconds, *args])
                 for p, (keys, args) in groups.items()]
        return sum(await self._run(self._put_rewards, calls))

    async def get_history(self, prompt_ids: Sequence[str], max_epochs: int = 0,
                          include_tokens: bool = True) -> list[list[Epoch]]:
        """The newest ``max_epochs`` epochs (0 = all kept) of each prompt, newest first.

        Returns one list per requested prompt, in request order (empty if none
        is stored). Without tokens, no token bytes leave Redis.
        """
        if max_epochs < 0:
            raise InvalidArgument(f"must be >= 0, got {max_epochs}", field="max_epochs")
        for n, prompt_id in enumerate(prompt_ids):
            if not prompt_id:
                raise InvalidArgument("must be non-empty", field=f"prompt_ids[{n}]")
        calls = [([self.keys.epochs(p)], [self.keys.epoch_stem(p), max_epochs, int(include_tokens)])
                 for p in prompt_ids]
        replies = await self._run(self._get_history, calls)
        return [[_epoch_from_reply(epoch) for epoch in reply] for reply in replies]

    async def _run(self, script: _Script, calls: list[tuple[list, list]]) -> list:
        """Runs ``script`` once per (keys, args) in one pipeline; loads it if Redis lacks it."""
        results = await self._pipeline(script, calls)
        missing = [n for n, result in enumerate(results) if isinstance(result, NoScriptError)]
        if missing:  # first call on this Redis, or after a restart / SCRIPT FLUSH
            await self._guarded(self.client.script_load(script.text))
            for n, result in zip(missing, await self._pipeline(script, [calls[n] for n in missing])):
                results[n] = result
        for result in results:
            if isinstance(result, ResponseError):
                if str(result).startswith("OOM"):
                    raise ResourceExhausted(f"{self.where} is out of memory: {result}")
                raise result
        return results

    async def _pipeline(self, script: _Script, calls: list[tuple[list, list]]) -> list:
        if not calls:
            return []
        pipe = self.client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        return await self._guarded(pipe.execute(raise_on_error=False))

    async def _guarded(self, awaitable):
        try:
            return await awaitable
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise Unavailable(f"{self.where} is unreachable: {exc}") from exc


def _check_ids(where: str, prompt_id: str, step_id: str, sample_index: int) -> None:
    if not prompt_id:
        raise InvalidArgument("must be non-empty", field=f"{where}.prompt_id")
    if not step_id:
        raise InvalidArgument("must be non-empty", field=f"{where}.step_id")
    if sample_index < 0:
        raise InvalidArgument(f"must be >= 0, got {sample_index}", field=f"{where}.sample_index")


def _epoch_from_reply(reply: list) -> Epoch:
    step_id, version, packed_lengths, packed_rewards, packed_tokens = reply  # see _GET_HISTORY
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
