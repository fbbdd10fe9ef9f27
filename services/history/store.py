"""HistoryStore: the last K epochs of rollouts per prompt, kept in Redis.

Each public call costs one Redis round trip per ``PIPELINE_CALLS`` prompts it covers:
one Lua script call per prompt, sent in pipelines of that many. Lua is what
makes one round trip possible: a read must first learn a prompt's epoch list
before it can fetch the epochs, and a write must check, append and evict
atomically; both happen inside the script, next to the data. The key layout
is in keys.py, the scripts in scripts.py, the records in records.py. This module
knows nothing about gRPC.

Every field a client sends is checked before anything is written (a refused call writes
nothing), and every size it controls is bounded: ids as the scheduler's
(``services.common.validation.check_id``), token ids and sample indices an int32, and one call
carries at most ``MAX_PER_PROMPT`` rollouts (or rewards) of one prompt, so no single
script keeps Redis busy for long (Redis serves nobody else while a script runs).
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
from services.common.validation import MAX_N, check_id
from services.history.keys import HistoryKeys
from services.history.records import Epoch, Reward, Rollout, epoch_from_reply
from services.history.scripts import GET_HISTORY, PUT_REWARDS, PUT_ROLLOUTS, Script

MAX_TOKEN_ID = 2**31 - 1  # token ids are int32s >= 0 (what the workers' drafters take)
MAX_SAMPLE_INDEX = 2**31 - 1  # an int32, as in the protos and the packed lengths
# Tokens of one rollout: above any context a policy samples to today (a 20M-token rollout
# was stored, and every later read of its prompt carried it to the workers' drafters).
MAX_ROLLOUT_TOKENS = 1 << 21
# Rollouts (or rewards) of one prompt in one call: the most samples of a prompt in a step
# (the scheduler writes a step per call). Each prompt's part of a call is one Lua script.
MAX_PER_PROMPT = MAX_N
# Script calls per pipeline: a round trip of a few hundred KB, whatever the step's size.
PIPELINE_CALLS = 2048


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
            InvalidArgument: a rollout has an empty or too long id, a sample index or a
                token id out of range, or a prompt has more than MAX_PER_PROMPT rollouts
                in the call; nothing of the call is written.
            Unavailable: Redis cannot be reached.
        """
        groups: dict[str, dict[str, tuple[int, list]]] = {}  # prompt -> step -> (version, [index, tokens]*)
        per_prompt: dict[str, int] = {}
        for n, r in enumerate(rollouts):
            _check_ids(f"rollouts[{n}]", r.prompt_id, r.step_id, r.sample_index)
            _count(per_prompt, r.prompt_id, f"rollouts[{n}]", "rollouts")
            packed = _packed_tokens(f"rollouts[{n}].token_ids", r.token_ids)
            steps = groups.setdefault(r.prompt_id, {})
            _, samples = steps.setdefault(r.step_id, (int(r.policy_version), []))
            samples += [int(r.sample_index), packed]
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
        """Stores rewards beside their rollouts; returns how many were new.

        Raises:
            InvalidArgument: as put_rollouts (ids, sample index, MAX_PER_PROMPT).
            Unavailable: Redis cannot be reached.
        """
        groups: dict[str, tuple[list, list]] = {}  # prompt -> (epoch keys, [index, packed reward]*)
        per_prompt: dict[str, int] = {}
        for n, r in enumerate(rewards):
            _check_ids(f"rewards[{n}]", r.prompt_id, r.step_id, r.sample_index)
            _count(per_prompt, r.prompt_id, f"rewards[{n}]", "rewards")
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

        Raises:
            InvalidArgument: max_epochs < 0, or a prompt id empty, too long or repeated
                (a repeat would only multiply the reply).
            Unavailable: Redis cannot be reached.
        """
        if max_epochs < 0:
            raise InvalidArgument(f"must be >= 0, got {max_epochs}", field="max_epochs")
        first: dict[str, int] = {}
        for n, prompt_id in enumerate(prompt_ids):
            check_id(prompt_id, f"prompt_ids[{n}]")
            if first.setdefault(prompt_id, n) != n:
                raise InvalidArgument(f"repeats prompt_ids[{first[prompt_id]}]", field=f"prompt_ids[{n}]")
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
                if str(result).startswith("BUSY"):  # another client's script still runs
                    raise Unavailable(f"{self.where} is busy: {result}")
                raise result
        return results

    async def _pipeline(self, script: Script, calls: list[tuple[list, list]]) -> list:
        """The calls' replies, in order, sent PIPELINE_CALLS to a round trip: one pipeline
        of a whole step's prompts (a quarter million) was written and read back as one, past
        the socket's timeout (a GetHistory of 1,000,000 ids failed with UNAVAILABLE)."""
        results = []
        for start in range(0, len(calls), PIPELINE_CALLS):
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls[start:start + PIPELINE_CALLS]:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            results += await self._guarded(pipe.execute(raise_on_error=False))
        return results

    async def _guarded(self, awaitable):
        try:
            return await awaitable
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise Unavailable(f"{self.where} is unreachable: {exc}") from exc


def _check_ids(where: str, prompt_id: str, step_id: str, sample_index: int) -> None:
    check_id(prompt_id, f"{where}.prompt_id")
    check_id(step_id, f"{where}.step_id")
    if not 0 <= sample_index <= MAX_SAMPLE_INDEX:
        raise InvalidArgument(f"must be in [0, {MAX_SAMPLE_INDEX}], got {sample_index}", field=f"{where}.sample_index")


def _count(per_prompt: dict[str, int], prompt_id: str, where: str, what: str) -> None:
    """One more entry of ``prompt_id`` in the call; at most MAX_PER_PROMPT."""
    num = per_prompt[prompt_id] = per_prompt.get(prompt_id, 0) + 1
    if num > MAX_PER_PROMPT:
        raise InvalidArgument(f"more than {MAX_PER_PROMPT} {what} of this prompt in one call (send them in "
                              f"several)", field=f"{where}.prompt_id")


def _packed_tokens(field: str, token_ids) -> bytes:
    """Token ids packed as little-endian int32; InvalidArgument naming the first one out of
    [0, MAX_TOKEN_ID] (``field[i]``): a worker's drafter refuses such a response; or
    naming ``field`` past MAX_ROLLOUT_TOKENS."""
    try:
        arr = np.asarray(token_ids)
        if arr.dtype.kind not in "iu":  # [] (float64), or Python ints past int64: refused below
            arr = np.asarray(token_ids, dtype=np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidArgument(f"token ids must be integers ({exc})", field=field) from None
    arr = arr.reshape(-1)
    if arr.size > MAX_ROLLOUT_TOKENS:
        raise InvalidArgument(f"at most {MAX_ROLLOUT_TOKENS} tokens, got {arr.size}", field=field)
    if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN_ID):
        n = int(np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))[0])
        raise InvalidArgument(f"token id {int(arr[n])} is out of range [0, {MAX_TOKEN_ID}]", field=f"{field}[{n}]")
    return arr.astype("<i4", copy=False).tobytes()
