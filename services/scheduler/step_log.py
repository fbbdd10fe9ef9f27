"""Each step's finished samples, kept in Redis so they survive a scheduler restart.

A trainer that re-submits a step id after the scheduler was killed gets every sample
once: the ones logged are replayed, only the missing ones are generated. A sample is
logged before the trainer sees it (writes are group-committed: one pipeline for all
samples finishing together), so a sample a trainer has seen is never generated twice
unless Redis itself lost it.

One hash per step, ``rhymerl:step:{<sha256 of the step id>}`` (hashed: bounded key
size; braces: one cluster slot), every write refreshing its TTL:
  ``fp``        the request's fingerprint (a re-submission must match it)
  ``prompts``   JSON [prompt ids, n]: what ReportRewards checks a reward against
  ``s:<json [prompt_id, sample_index]>``  a SampleResult
  ``summary``   the StepSummary, once the step finished

Beside the steps, ``rhymerl:serving`` records the weight version a push made serving
(its SHA-256 or the path it was loaded from): a restarted scheduler needs it as much as
the samples (``serving.py``).

Redis is an aid, never a dependency: while it is down, writes are skipped for
``retry_s`` (the trainer still gets every sample live) and reads find nothing. A write
that fails on a connection broken by a Redis restart is retried once at once, on a new
connection, before Redis counts as down.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from rhymerl.v1 import rollout_pb2

from services.common import metrics

log = logging.getLogger(__name__)
SERVING_KEY = "rhymerl:serving"


class RecordUnreadable(Exception):
    """Redis is configured but could not be read: a record may exist."""


@dataclass
class LoggedStep:
    fingerprint: str
    prompt_ids: set[str]
    n: int
    samples: list[rollout_pb2.SampleResult] = field(default_factory=list)
    summary: rollout_pb2.StepSummary | None = None


def step_key(step_id: str) -> str:
    return "rhymerl:step:{" + hashlib.sha256(step_id.encode()).hexdigest()[:32] + "}"


class StepLog:
    """Args:
        url: the Redis to keep the log in; empty: no log (a restart loses unfinished steps).
        ttl_s: how long a step's log outlives its last write.
        timeout_s: a Redis call slower than this counts as Redis down.
        retry_s: after a failure, writes are skipped this long (no sample waits on a dead Redis).
    """

    def __init__(self, url: str, ttl_s: float = 86_400, timeout_s: float = 1.0, retry_s: float = 5.0):
        self._client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s) \
            if url else None
        self.ttl_s, self.timeout_s, self.retry_s = int(ttl_s), timeout_s, retry_s
        self._down_until = 0.0
        self._pending: list[tuple[str, dict, asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self._client is not None

    async def load(self, step_id: str, samples: bool = True) -> LoggedStep | None:
        """The step's log (without its samples when ``samples`` is False), or None: never
        logged, expired, or Redis unreachable."""
        if self._client is None:
            return None
        key = step_key(step_id)
        try:
            if samples:
                fields = await asyncio.wait_for(self._client.hgetall(key), self.timeout_s * 5)
            else:
                values = await asyncio.wait_for(self._client.hmget(key, ["fp", "prompts"]), self.timeout_s * 5)
                fields = {name: v for name, v in zip((b"fp", b"prompts"), values) if v is not None}
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            log.warning("step log unreadable for step %r: %s", step_id, exc)
            return None
        if b"fp" not in fields or b"prompts" not in fields:
            return None
        prompt_ids, n = json.loads(fields[b"prompts"])
        logged = LoggedStep(fields[b"fp"].decode(), set(prompt_ids), n)
        for name, value in fields.items():
            if name.startswith(b"s:"):
                logged.samples.append(rollout_pb2.SampleResult.FromString(value))
        if b"summary" in fields:
            logged.summary = rollout_pb2.StepSummary.FromString(fields[b"summary"])
        return logged

    async def open(self, step_id: str, fingerprint: str, prompt_ids: list[str], n: int) -> None:
        await self._write(step_key(step_id), {"fp": fingerprint, "prompts": json.dumps([sorted(prompt_ids), n])})

    async def append(self, step_id: str, samples: list[rollout_pb2.SampleResult]) -> None:
        """Returns once the samples are in Redis (or Redis is down: then at once)."""
        await self._write(step_key(step_id), {
            "s:" + json.dumps([s.prompt_id, s.sample_index]): s.SerializeToString() for s in samples})

    async def close(self, step_id: str, summary: rollout_pb2.StepSummary) -> None:
        await self._write(step_key(step_id), {"summary": summary.SerializeToString()})

    async def save_serving(self, version: int, sha256: str, path: str) -> bool:
        """True once it is in Redis (False: Redis down or no log)."""
        return await self._write(SERVING_KEY, {"version": str(version), "sha256": sha256, "path": path})

    async def load_serving(self) -> tuple[int, str, str] | None:
        """(version, sha256, path) of the last push recorded, or None (no record, no Redis).

        Raises:
            RecordUnreadable: Redis is configured but did not answer.
        """
        if self._client is None:
            return None
        try:
            fields = await asyncio.wait_for(self._client.hgetall(SERVING_KEY), self.timeout_s * 5)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise RecordUnreadable(f"serving version unreadable: {exc}") from exc
        if b"version" not in fields:
            return None
        return int(fields[b"version"]), fields.get(b"sha256", b"").decode(), fields.get(b"path", b"").decode()

    async def shutdown(self) -> None:
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def _write(self, key: str, mapping: dict) -> bool:
        """True once written; False when skipped (no log, Redis down) or failed."""
        if self._client is None or not mapping:
            return False
        if time.monotonic() < self._down_until:
            metrics.step_log_writes.labels(result="skipped").inc(len(mapping))
            return False
        done = asyncio.get_running_loop().create_future()
        self._pending.append((key, mapping, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await asyncio.shield(done)  # a cancelled waiter does not cancel the others' write

    async def _execute(self, batch: list[tuple[str, dict, asyncio.Future]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key, mapping, _ in batch:
            pipe.hset(key, mapping=mapping)
            pipe.expire(key, self.ttl_s)
        await asyncio.wait_for(pipe.execute(), self.timeout_s * 5)

    async def _flush(self) -> None:
        """Group commit: everything queued while the previous pipeline ran goes in the next."""
        while self._pending:
            batch, self._pending = self._pending, []
            result = "ok"
            try:
                try:
                    await self._execute(batch)
                except (RedisConnectionError, ConnectionError):
                    # A pooled connection from before a Redis restart fails once; a new
                    # one is made for the retry (the writes are idempotent: HSET, EXPIRE).
                    await self._execute(batch)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.warning("step log write failed (%s); skipping writes for %.0f s", exc, self.retry_s)
                self._down_until, result = time.monotonic() + self.retry_s, "failed"
            metrics.step_log_writes.labels(result=result).inc(sum(len(m) for _, m, _ in batch))
            for _, _, done in batch:
                if not done.done():
                    done.set_result(result == "ok")
