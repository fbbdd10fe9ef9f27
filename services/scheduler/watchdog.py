"""Watches the fleet: adds reachable static workers, polls every worker's health, drops
the silent and the drained, catches lagging workers up, ends work no worker can take,
and keeps the scheduler's readiness truthful (SERVING only while a worker can serve).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from services.scheduler.core import SchedulerCore
from services.scheduler.weight_fanout import WeightFanout
from services.scheduler.workers import WorkerHandle

log = logging.getLogger(__name__)


class Watchdog:
    """Args:
        core: the scheduler core (its worker table, link and version).
        weights: catches up workers on an old version.
        static: addresses of workers that do not register themselves.
        timeout_s: a worker silent this long is dropped (its work re-queued long before).
        set_ready: called with whether some worker serves the current version.
    """

    def __init__(self, core: SchedulerCore, weights: WeightFanout, static: list[str], timeout_s: float,
                 set_ready: Callable[[bool], Awaitable[None]], interval_s: float = 2.0):
        self.core, self.weights, self.static = core, weights, static
        self.timeout_s, self.set_ready, self.interval_s = timeout_s, set_ready, interval_s

    async def run(self) -> None:
        while True:
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 - the watchdog must outlive any one bad poll
                log.exception("fleet check failed")
            await asyncio.sleep(self.interval_s)

    async def check_once(self) -> None:
        core, table = self.core, self.core.workers
        await self._add_static()
        workers = list(table.workers.values())
        answers = await asyncio.gather(*(self._poll(w) for w in workers))
        now = time.monotonic()
        for w, answered in zip(workers, answers):
            if not answered:
                core.worker_lost(w)
                if now - w.last_seen > self.timeout_s:
                    await self.remove(w, "silent")
            elif not w.accepting and not w.state.running:
                await self.remove(w, "drained")
            elif w.policy_version < core.policy_version:
                core.spawn(self.weights.catch_up(w))
        core.settle_version()
        await self.weights.reread_record()
        await self.weights.record()
        core.abort_if_no_workers()
        core.wake()
        await self.refresh()

    async def refresh(self) -> None:
        core = self.core
        await self.set_ready(core.serving.dispatchable and bool(core.workers.serving(core.policy_version)))

    async def remove(self, w: WorkerHandle, why: str) -> None:
        log.warning("dropping worker %s (%s)", w.worker_id, why)
        self.core.worker_lost(w)
        self.core.workers.remove(w.worker_id)
        await self.core.link.forget(w.worker_id)

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
                               stats.vocab_size, stats.max_model_len)
