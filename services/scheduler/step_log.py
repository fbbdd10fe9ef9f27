"""Each step's finished samples, kept in Redis so they survive a scheduler restart.

A trainer that re-submits a step id after the scheduler was killed gets every sample
once: the ones logged are replayed, only the missing ones are generated. A sample is
logged before the trainer sees it (writes are group-committed: one pipeline for all
samples finishing together), so a sample a trainer has seen is never generated twice
unless Redis itself lost it.

One hash per step, ``<prefix>:step:{<sha256 of the step id>}`` (hashed: bounded key
size; braces: one cluster slot), every write refreshing its TTL:
  ``fp``        the request's fingerprint (a re-submission must match it)
  ``prompts``   JSON [prompt ids, n]: what ReportRewards checks a reward against
  ``s:<json [prompt_id, sample_index]>``  a SampleResult
  ``summary``   the StepSummary, once the step finished

(``<prefix>``: the setting ``key_prefix``, ``rhymerl`` unless releases share a Redis.)
Beside the steps, ``<prefix>:serving`` (a shard's: ``<prefix>:serving:<shard id>``, each
shard its own, since a push may reach one shard and not another) records the weight
version a push made serving (its SHA-256 or the path it was loaded from): a restarted scheduler needs it as much as
the samples (``serving.py``).

While Redis does not answer, a sample waits for it: its write (and the step's record,
and a re-submission's read) is retried for up to ``hold_s``, and only then does the
sample go to the trainer unlogged. A sample the trainer saw without the log is
generated again by a restarted scheduler at whatever version then serves: after a
push, other tokens under the same (prompt, sample index), which the trainer already
has (the chaos campaign's duplicates: Redis killed, the log skipped for 5 s while the
samples streamed, the scheduler killed, a push before the trainer re-submitted). So
Redis is a dependency only for ``hold_s`` (a Redis restart takes seconds): past it,
writes are skipped (for ``retry_s`` at a time, then tried again) and reads find
nothing until Redis answers again, and a restart in that time may regenerate what the
trainer saw. A write that fails on a connection broken by a Redis restart is retried
at once, on a new connection.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import math
import time
from dataclasses import dataclass, field

from rhymerl.v1 import rollout_pb2

from services.common import metrics
from services.history.keys import DEFAULT_PREFIX, check_prefix

log = logging.getLogger(__name__)


class RecordUnreadable(Exception):
    """Redis is configured but could not be read: a record may exist."""


@dataclass
class LoggedStep:
    fingerprint: str
    prompt_ids: set[str]
    n: int
    samples: list[rollout_pb2.SampleResult] = field(default_factory=list)
    summary: rollout_pb2.StepSummary | None = None


def step_key(step_id: str, prefix: str = DEFAULT_PREFIX) -> str:
    return f"{prefix}:step:{{" + hashlib.sha256(step_id.encode()).hexdigest()[:32] + "}"


class StepLog:
    """Args:
        url: the Redis to keep the log in; empty: no log (a restart loses unfinished steps).
        ttl_s: how long a step's log outlives its last write.
        timeout_s: a Redis call slower than this counts as Redis down.
        hold_s: how long samples (and reads) wait for a Redis that does not answer,
            retried meanwhile; 0: they never wait.
        retry_s: once an outage outlasted ``hold_s``, writes are skipped this long at a time.
        key_prefix: the prefix of its keys (``check_prefix``: non-empty, brace-free).
        shard_id: a shard's name: its serving record is its own.
    """

    def __init__(self, url: str, ttl_s: float = 86_400, timeout_s: float = 1.0, retry_s: float = 5.0,
                 hold_s: float = 30.0, key_prefix: str = DEFAULT_PREFIX, shard_id: str = ""):
        self.prefix = check_prefix(key_prefix)
        self.serving_key = f"{key_prefix}:serving" + (f":{shard_id}" if shard_id else "")
        self._client = None
        # what a Redis call may raise when Redis is down (redis's own errors once it is loaded)
        self._errors: tuple[type[BaseException], ...] = (OSError, asyncio.TimeoutError)
        self._reconnect_errors: tuple[type[BaseException], ...] = (ConnectionError,)
        if url:  # redis is imported here only: a scheduler without a step log never loads it (~12 MB)
            import redis.asyncio as aioredis
            from redis.exceptions import ConnectionError as RedisConnectionError
            from redis.exceptions import RedisError

            self._client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
            self._errors = (RedisError, *self._errors)
            self._reconnect_errors = (RedisConnectionError, *self._reconnect_errors)
        # (whole seconds, at least one: EXPIRE 0 would delete each key as it is written)
        self.ttl_s, self.timeout_s, self.retry_s, self.hold_s = max(1, math.ceil(ttl_s)), timeout_s, retry_s, hold_s
        self._down_until = 0.0  # writes skipped until then (an outage longer than ``hold_s``)
        self._outage_since: float | None = None  # the first failure since Redis last answered
        self._pending: list[tuple[str, dict, asyncio.Future, bool]] = []  # (key, fields, done, held)
        self._flusher: asyncio.Task | None = None
        self._closing = asyncio.Event()  # shutdown: nothing waits any more

    def _key(self, step_id: str) -> str:
        return step_key(step_id, self.prefix)

    @property
    def holding(self) -> bool:
        """Whether writes are waiting for Redis to answer again."""
        return self._outage_since is not None and not self._hold_expired()

    def _hold_expired(self) -> bool:
        return self._closing.is_set() or (self._outage_since is not None
                                          and time.monotonic() - self._outage_since >= self.hold_s)

    def _failed(self) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()

    async def _pause(self, attempt: int) -> None:
        """Between two tries while Redis does not answer (a shutdown ends it at once)."""
        try:
            await asyncio.wait_for(self._closing.wait(), min(1.0, 0.05 * 2 ** attempt))
        except asyncio.TimeoutError:
            pass

    @property
    def enabled(self) -> bool:
        return self._client is not None

    async def load(self, step_id: str, samples: bool = True) -> LoggedStep | None:
        """The step's log (without its samples when ``samples`` is False), or None: never
        logged, expired, or Redis unreachable for ``hold_s`` (retried meanwhile: a step
        read as never logged is generated again, what the trainer saw included)."""
        if self._client is None:
            return None
        key = self._key(step_id)
        for attempt in itertools.count():
            try:
                if samples:
                    fields = await asyncio.wait_for(self._client.hgetall(key), self.timeout_s * 5)
                else:
                    values = await asyncio.wait_for(self._client.hmget(key, ["fp", "prompts"]), self.timeout_s * 5)
                    fields = {name: v for name, v in zip((b"fp", b"prompts"), values) if v is not None}
                self._outage_since = None
                break
            except self._errors as exc:
                self._failed()
                if self._hold_expired():
                    log.warning("step log unreadable for step %r: %s", step_id, exc)
                    return None
                if attempt == 0:
                    log.warning("step log unreadable for step %r (%s); retrying for up to %.0f s", step_id, exc,
                                self.hold_s)
                await self._pause(attempt)
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
        await self._write(self._key(step_id), {"fp": fingerprint, "prompts": json.dumps([sorted(prompt_ids), n])})

    async def append(self, step_id: str, samples: list[tuple[tuple[str, int], bytes]]) -> bool:
        """Logs ((prompt_id, sample_index), serialized SampleResult) pairs. True once the
        samples are in Redis; False when Redis did not take them within ``hold_s`` (or the
        log is off)."""
        if not self.enabled:
            return False
        return await self._write(self._key(step_id), {"s:" + json.dumps(list(key)): sample for key, sample in samples})

    async def close(self, step_id: str, summary: rollout_pb2.StepSummary) -> None:
        """Not held (the trainer waits for the summary): a restarted scheduler that finds
        every sample logged but no summary replays them and writes it again."""
        await self._write(self._key(step_id), {"summary": summary.SerializeToString()}, hold=False)

    async def save_serving(self, version: int, sha256: str, path: str) -> bool:
        """True once it is in Redis (False: Redis down or no log). Not held (a push waits
        on it): the watchdog writes it again until Redis takes it. Kept without a TTL (the
        step log's would drop it after a quiet spell: a restarted scheduler then had no
        source to catch workers that restart on older weights up from)."""
        return await self._write(self.serving_key, {"version": str(version), "sha256": sha256, "path": path},
                                 hold=False)

    async def load_serving(self) -> tuple[int, str, str] | None:
        """(version, sha256, path) of the last push recorded, or None (no record, no Redis).

        Raises:
            RecordUnreadable: Redis is configured but did not answer.
        """
        if self._client is None:
            return None
        try:
            fields = await asyncio.wait_for(self._client.hgetall(self.serving_key), self.timeout_s * 5)
        except self._errors as exc:
            raise RecordUnreadable(f"serving version unreadable: {exc}") from exc
        if b"version" not in fields:
            return None
        return int(fields[b"version"]), fields.get(b"sha256", b"").decode(), fields.get(b"path", b"").decode()

    async def shutdown(self) -> None:
        self._closing.set()
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()

    async def _write(self, key: str, mapping: dict, hold: bool = True) -> bool:
        """True once written; False when skipped (no log, Redis down past ``hold_s``) or
        failed. With ``hold``, a write Redis does not take is retried for up to ``hold_s``."""
        if self._client is None or not mapping:
            return False
        if time.monotonic() < self._down_until:
            metrics.step_log_writes.labels(result="skipped").inc(len(mapping))
            return False
        done = asyncio.get_running_loop().create_future()
        self._pending.append((key, mapping, done, hold))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        return await asyncio.shield(done)  # a cancelled waiter does not cancel the others' write

    async def _execute(self, batch: list[tuple[str, dict, asyncio.Future, bool]]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key, mapping, _, _ in batch:
            pipe.hset(key, mapping=mapping)
            if key == self.serving_key:  # kept until the next push: it must outlive any quiet spell
                pipe.persist(key)  # (one written with a TTL by an earlier release loses it)
            else:
                pipe.expire(key, self.ttl_s)
        await asyncio.wait_for(pipe.execute(), self.timeout_s * 5)

    async def _flush(self) -> None:
        """Group commit: everything queued while the previous pipeline ran goes in the next.
        While Redis does not answer, the held writes are tried again (with whatever was
        queued meanwhile) until ``hold_s`` after the first failure; the others fail at once."""
        attempt = 0
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                try:
                    await self._execute(batch)
                except self._reconnect_errors:
                    # A pooled connection from before a Redis restart fails once; a new
                    # one is made for the retry (the writes are idempotent: HSET, EXPIRE).
                    await self._execute(batch)
            except self._errors as exc:
                self._failed()
                metrics.step_log_writes.labels(result="failed").inc(sum(len(m) for _, m, _, _ in batch))
                expired = self._hold_expired()
                held = [] if expired else [w for w in batch if w[3]]
                self._resolve([w for w in batch if not w[3] or expired], False)
                if held:
                    if attempt == 0:
                        log.warning("step log write failed (%s); its samples wait for Redis (up to %.0f s)", exc,
                                    self.hold_s)
                    await self._pause(attempt)
                    attempt += 1
                    self._pending = held + self._pending
                    continue
                if not expired:  # only writes that do not wait (a summary, the serving record) failed
                    log.warning("step log write failed (%s)", exc)
                    continue
                log.warning("step log write failed (%s); Redis down %.0f s: skipping writes for %.0f s (a "
                            "restarted scheduler regenerates what they held)", exc,
                            time.monotonic() - self._outage_since, self.retry_s)
                self._down_until = time.monotonic() + self.retry_s
                continue
            attempt, self._outage_since = 0, None
            metrics.step_log_writes.labels(result="ok").inc(sum(len(m) for _, m, _, _ in batch))
            self._resolve(batch, True)

    @staticmethod
    def _resolve(batch: list[tuple[str, dict, asyncio.Future, bool]], ok: bool) -> None:
        for _, _, done, _ in batch:
            if not done.done():
                done.set_result(ok)
