"""Watches the fleet: marks workers that missed their heartbeats lost, drops the silent
and the drained, adds and polls static workers, ends work no worker can take, and keeps
the scheduler's readiness truthful (SERVING only while a worker can serve).

One sign of life per worker. A registered worker beats (``Register`` every
``heartbeat_s``, the interval the scheduler names in its answer); the scheduler never
polls it. A static worker (``RHYMERL_SCHEDULER_WORKERS``) sends nothing, so it alone is
polled (``GetWorkerStats``), every ``heartbeat_s``. The watchdog's round, every
``sweep_s``, costs O(1) plus the silent, draining and static workers: the table hands
it the silent ones (``WorkerTable.silent``) without a scan of the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from services.scheduler.core import SchedulerCore
from services.scheduler.weight_fanout import WeightFanout
from services.scheduler.workers import WorkerHandle

log = logging.getLogger(__name__)

MISSED_BEATS = 3  # a registered worker silent this many intervals is lost: its chunks run elsewhere
MIN_SHARE = 0.05  # the least a round of silence counts, however few beats the scheduler read (below)


class Watchdog:
    """Args:
        core: the scheduler core (its worker table, link and version).
        weights: catches up workers on an old version.
        static: addresses of workers that do not register themselves.
        timeout_s: a worker silent this long is dropped (its work re-queued long before).
        set_ready: called with whether some worker serves the current version (on a change).
        heartbeat_s: the workers' beat interval (and the static workers' poll interval).
    """

    def __init__(self, core: SchedulerCore, weights: WeightFanout, static: list[str], timeout_s: float,
                 set_ready: Callable[[bool], Awaitable[None]], heartbeat_s: float = 5.0):
        self.core, self.weights, self.static = core, weights, static
        self.timeout_s, self.set_ready, self.heartbeat_s = timeout_s, set_ready, heartbeat_s
        self.lost_after_s = MISSED_BEATS * heartbeat_s
        self.sweep_s = min(1.0, heartbeat_s)
        self._ready: bool | None = None
        self._last_round = time.monotonic()
        self._slept_at = float("-inf")  # when run() last began its sleep between rounds (none yet)
        self._beats: deque[tuple[float, int]] = deque()  # (round, beats read since the one before), one interval
        self._next_poll = 0.0

    async def run(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one bad poll
                log.exception("fleet check failed")
            self._slept_at = time.monotonic()
            await asyncio.sleep(self.sweep_s)

    async def check_once(self) -> None:
        core, table, now = self.core, self.core.workers, time.monotonic()
        self._advance_heard_clock(now)
        for w in table.silent(table.heard_clock - self.lost_after_s):
            if w.state.healthy:
                log.warning("worker %s missed %d heartbeats (%.1f s silent, %.1f s of them heard)", w.worker_id,
                            MISSED_BEATS, now - w.last_seen, table.heard_clock - w.last_heard)
                core.worker_lost(w)
            if table.heard_clock - w.last_heard > self.timeout_s:
                await self.remove(w, "silent")
        if self.static and now >= self._next_poll:
            self._next_poll = now + self.heartbeat_s
            await self._poll_static()
        for w in list(table.draining.values()):
            if not w.state.running:
                await self.remove(w, "drained")
        core.settle_version()
        await self.weights.reread_record()
        await self.weights.record()
        core.abort_if_no_workers()
        core.cancel_abandoned()
        core.wake()
        await self.refresh()

    def _advance_heard_clock(self, now: float) -> None:
        """Advances the table's heard clock by the time since the last round, as far as
        the scheduler could hear: fully when this round came on time (the event loop
        free: silence is the workers') or when the beats read over the last interval
        number at least half the healthy fleet; in proportion below that. A scheduler
        whose loop is swamped (a huge step's chunk traffic queued ahead of the beats, which
        leaves its timers roughly on time but its beats unread for tens of seconds, seen
        at 512 and 1,024 fake workers) reads few beats from anyone: its clock slows or
        stops, and no worker is lost for the scheduler's own deafness. A fleet that
        truly went silent is lost on time: an idle loop's rounds come on time. A round
        counts for two at most. A round is late by how long its sleep overran, not by how
        long the round before it took (on a busy machine a round's own Redis calls can take
        half a second: counted as lateness, a dead worker alone in its fleet was never lost
        and readiness never fell). And silence always counts at least MIN_SHARE: a worker
        that stopped beating is lost within 1 / MIN_SHARE times its bound, however deaf
        the scheduler."""
        table = self.core.workers
        elapsed = now - self._last_round
        late = now - max(self._last_round, self._slept_at) - self.sweep_s
        self._last_round = now
        self._beats.append((now, table.beats))
        table.beats = 0
        while self._beats and self._beats[0][0] < now - self.heartbeat_s:
            self._beats.popleft()
        healthy = max(1, table.num_healthy)
        heard = min(1.0, sum(n for _, n in self._beats) / (0.5 * healthy))
        share = 1.0 if late < 0.5 * self.sweep_s else max(MIN_SHARE, heard)
        if share < 1.0 and late > self.heartbeat_s:
            log.info("the fleet check came %.1f s late and heard %.0f%% of the fleet: silence counts %.0f%%",
                     late, 100 * heard, 100 * share)
        # at most two rounds' worth: beats read just before this round were stamped with
        # the clock as it stood, and must not look a whole stall old
        table.heard_clock += min(elapsed, 2 * self.sweep_s) * share

    async def refresh(self) -> None:
        """Readiness, published when it changes: O(1)."""
        core = self.core
        ready = core.serving.dispatchable and core.workers.any_serving(core.policy_version)
        if ready != self._ready:
            self._ready = ready
            await self.set_ready(ready)

    async def remove(self, w: WorkerHandle, why: str) -> None:
        log.warning("dropping worker %s (%s)", w.worker_id, why)
        self.core.worker_lost(w)
        self.core.workers.remove(w.worker_id)
        await self.core.link.forget(w.worker_id)

    async def _poll_static(self) -> None:
        await self._add_static()
        workers = self.core.workers.polled_workers()
        answers = await asyncio.gather(*(self._poll(w) for w in workers))
        now = time.monotonic()
        for w, answered in zip(workers, answers):
            if not answered:
                self.core.worker_lost(w)
                if now - w.last_seen > self.timeout_s:
                    await self.remove(w, "silent")
            elif w.policy_version < self.core.policy_version:
                self.core.spawn(self.weights.catch_up(w))

    async def _poll(self, w: WorkerHandle) -> bool:
        try:
            stats = await self.core.link.stats(w)
        except Exception:  # noqa: BLE001 - any failure is an unanswered poll
            return False
        self.core.workers.mark_healthy(w, stats.policy_version, stats.accepting)
        return True

    async def _add_static(self) -> None:
        known = {w.address for w in self.core.workers.workers.values()}
        for address in self.static:
            if address in known:
                continue
            try:
                stats = await self.core.link.probe(address)
            except Exception:  # noqa: BLE001 - not up yet
                continue
            self.core.register(stats.worker_id or address, address, stats.max_num_seqs or 1, stats.policy_version,
                               stats.vocab_size, stats.max_model_len, draining=not stats.accepting, polled=True)
