"""Shard discovery through Redis: each scheduler shard announces itself, the step router reads.

A shard (one ``rhymerl scheduler`` process and the workers registered with it) writes one
key, ``<prefix>:shard:<shard_id>`` (``<prefix>``: ``key_prefix``, ``rhymerl`` unless
releases share a Redis), holding its address, its capacity (the slots of its
usable workers: how many samples it runs at once), its serving policy version and what
its fleet can serve (vocabulary, maximum length), with a TTL of ``ttl_s``, rewritten every
``min(ttl_s / 3, 1 s)`` (a new worker's capacity shows within a second). A shard that
stops (or hangs, or loses Redis) disappears when its key expires; a shard that exits
cleanly deletes its key. The router scans the keys every ``refresh_s``: O(shards) per
scan, nothing per sample.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from services.history.keys import DEFAULT_PREFIX, check_prefix

log = logging.getLogger(__name__)


def shard_prefix(key_prefix: str = DEFAULT_PREFIX) -> str:
    """What every shard's key starts with."""
    return f"{check_prefix(key_prefix)}:shard:"


def _glob_escaped(text: str) -> str:
    """`text` matched literally in a SCAN pattern (a prefix may hold *, ?, [ or \\)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def steps_key(key_prefix: str = DEFAULT_PREFIX) -> str:
    """The router's steps in flight: step id -> the version it runs at, while it runs."""
    return f"{check_prefix(key_prefix)}:router:steps"


@dataclass(frozen=True)
class ShardInfo:
    """One shard as it announced itself."""

    shard_id: str
    address: str
    capacity: int  # slots of its usable workers (samples it runs at once)
    workers: int
    policy_version: int
    vocab_size: int = 0  # 0: unknown (no worker yet)
    max_model_len: int = 0

    def encode(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def decode(cls, raw: bytes | str) -> "ShardInfo":
        fields = json.loads(raw)
        return cls(**{k: fields[k] for k in cls.__dataclass_fields__ if k in fields})


def advertised_address(host: str, port: int, configured: str = "") -> str:
    """The address other processes dial: the configured one, else host:port (the
    machine's own address when the server binds every interface)."""
    if configured:
        return configured
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


class ShardAnnouncer:
    """Runs inside a scheduler process: keeps its registry key fresh.

    Args:
        core: the scheduler core (its worker table and serving version are read).
        redis_url: the registry's Redis.
        shard_id: the key's name (unique per shard; default the address).
        address: what the router dials.
        ttl_s: the key's time to live; rewritten every min(ttl_s / 3, 1 s).
        key_prefix: the release's key prefix (the router's must be the same).
    """

    def __init__(self, core, redis_url: str, shard_id: str, address: str, ttl_s: float,
                 key_prefix: str = DEFAULT_PREFIX):
        self.core, self.shard_id, self.address, self.ttl_s = core, shard_id or address, address, ttl_s
        self.key = shard_prefix(key_prefix) + self.shard_id
        self.client = aioredis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._task: asyncio.Task | None = None

    def info(self) -> ShardInfo:
        usable = list(self.core.workers.usable())
        return ShardInfo(self.shard_id, self.address, sum(w.state.capacity for w in usable), len(usable),
                         self.core.policy_version,
                         min((w.vocab_size for w in usable if w.vocab_size), default=0),
                         min((w.max_model_len for w in usable if w.max_model_len), default=0))

    async def announce(self) -> None:
        await self.client.set(self.key, self.info().encode(), px=int(self.ttl_s * 1000))

    async def _run(self) -> None:
        while True:
            try:
                await self.announce()
            except (RedisError, OSError) as exc:  # the key expires; the router then treats the shard as gone
                log.warning("shard registry: could not announce %s: %s", self.shard_id, exc)
            await asyncio.sleep(min(self.ttl_s / 3, 1.0))

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())
        log.info("announcing shard %s at %s (ttl %g s)", self.shard_id, self.address, self.ttl_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        try:
            await self.client.delete(self.key)
        except (RedisError, OSError):
            pass
        await self.client.aclose()


class ShardDirectory:
    """The router's view of the registry: ``scan()`` returns the shards alive now."""

    def __init__(self, redis_url: str, key_prefix: str = DEFAULT_PREFIX):
        self.client = aioredis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.prefix, self.steps_key = shard_prefix(key_prefix), steps_key(key_prefix)

    async def scan(self) -> dict[str, ShardInfo]:
        keys = [k async for k in self.client.scan_iter(match=_glob_escaped(self.prefix) + "*", count=1000)]
        if not keys:
            return {}
        shards = {}
        for key, raw in zip(keys, await self.client.mget(keys)):
            if raw is None:  # expired between the scan and the read
                continue
            try:
                info = ShardInfo.decode(raw)
            except (ValueError, TypeError, KeyError) as exc:
                log.warning("shard registry: ignoring malformed entry %s: %s", key, exc)
                continue
            shards[info.shard_id] = info
        return shards

    # --- the router's steps in flight, for the router that restarts -------------------
    async def steps_in_flight(self) -> dict[str, int]:
        """The steps a router was running (step id -> version), as it recorded them."""
        return {k.decode(): int(v) for k, v in (await self.client.hgetall(self.steps_key)).items()}

    async def step_started(self, step_id: str, version: int) -> None:
        await self.client.hset(self.steps_key, step_id, version)

    async def step_finished(self, step_id: str) -> None:
        await self.client.hdel(self.steps_key, step_id)

    async def close(self) -> None:
        await self.client.aclose()
