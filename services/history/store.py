"""HistoryStore: the last K epochs of rollouts per prompt, kept in Redis.

Each public call costs one Redis round trip however many prompts it covers:
one Lua script call per prompt, all of them sent in one pipeline. Lua is what
makes one round trip possible: a read must first learn a prompt's epoch list
before it can fetch the epochs, and a write must check, append and evict
atomically; both happen inside the script, next to the data. The key layout
is in keys.py, the scripts in scripts.py, the records in records.py. This module
knows nothing about gRPC.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
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
from services.history.records import Epoch, Reward, Rollout, epoch_from_reply
from services.history.scripts import GET_HISTORY, PUT_REWARDS, PUT_ROLLOUTS, Script


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
        self._put_rollouts = Script(PUT_ROLLOUTS)
        self._put_rewards = Script(PUT_REWARDS)
        self._get_history = Script(GET_HISTORY)

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
        return [[epoch_from_reply(epoch) for epoch in reply] for reply in replies]

    async def _run(self, script: Script, calls: list[tuple[list, list]]) -> list:
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

    async def _pipeline(self, script: Script, calls: list[tuple[list, list]]) -> list:
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
