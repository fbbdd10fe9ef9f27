"""The scheduler's table of rollout workers: who is registered, healthy, on which version.

Knows no gRPC (the channels are the worker link's); what it holds is what the core
dispatches by and what readiness reports.

A registered worker's sign of life is its heartbeat (``Register`` again every
``heartbeat_s``), and each beat costs O(1) here: the table keeps its registered
workers in the order of their last beat (a beat moves its worker to the end), so the
watchdog finds the silent ones at the front without scanning the fleet; and it counts
the usable workers per policy version and the healthy ones as they change, so readiness
("does some worker serve the version?") and the metrics never scan it either. Every
change to a worker's health, version or accepting goes through the table's methods
(the handle's fields are read-only) so that those counts stay true.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict

from services.common import metrics
from services.scheduler.policies.base import WorkerState

log = logging.getLogger(__name__)


class WorkerHandle:
    """One worker as the scheduler knows it. ``polled``: a static worker, which sends no
    heartbeat; the watchdog polls its stats instead."""

    __slots__ = ("worker_id", "address", "state", "vocab_size", "max_model_len", "last_seen", "last_heard",
                 "polled", "_policy_version", "_accepting")

    def __init__(self, worker_id: str, address: str, state: WorkerState, policy_version: int = 0,
                 vocab_size: int = 0, max_model_len: int = 0, polled: bool = False):
        self.worker_id, self.address, self.state = worker_id, address, state
        self._policy_version, self._accepting = policy_version, True
        self.vocab_size, self.max_model_len, self.polled = vocab_size, max_model_len, polled
        self.last_seen = time.monotonic()
        self.last_heard = 0.0  # the table's heard clock at its last beat

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def accepting(self) -> bool:
        return self._accepting

    @property
    def can_take_work(self) -> bool:
        return self.state.healthy and self._accepting


class WorkerTable:
    """Workers known to the scheduler, by id."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerHandle] = {}
        self.draining: dict[str, WorkerHandle] = {}  # not accepting: dropped once their chunks are done
        self._by_beat: OrderedDict[str, WorkerHandle] = OrderedDict()  # registered ones, longest silent first
        self._usable = Counter()  # policy version -> workers that can take work on it
        self._serving: tuple[int, list[WorkerHandle]] | None = None  # (version, ``serving``), until a change
        self._healthy = 0
        # Seconds during which the scheduler could hear its workers (the watchdog advances
        # it): silence is measured on it, so beats the scheduler itself left unread (its
        # event loop busy with a huge step) never make a worker look silent.
        self.heard_clock = 0.0
        self.beats = 0  # beats read since the watchdog last took the count

    # --- the counts, kept as the workers change ---------------------------------------
    def _leave(self, w: WorkerHandle) -> None:
        self._serving = None
        if w.can_take_work:
            self._usable[w.policy_version] -= 1
        self._healthy -= w.state.healthy

    def _enter(self, w: WorkerHandle) -> None:
        self._serving = None
        if w.can_take_work:
            self._usable[w.policy_version] += 1
        self._healthy += w.state.healthy
        if w._accepting:
            self.draining.pop(w.worker_id, None)
        else:
            self.draining[w.worker_id] = w

    def _update(self, w: WorkerHandle, *, healthy: bool | None = None, version: int | None = None,
                accepting: bool | None = None) -> bool:
        """Sets what is given; True when anything changed."""
        new = (w.state.healthy if healthy is None else healthy, w._policy_version if version is None else version,
               w._accepting if accepting is None else accepting)
        if new == (w.state.healthy, w._policy_version, w._accepting):
            return False
        if self.workers.get(w.worker_id) is not w:  # dropped meanwhile (a push's late answer): not counted
            w.state.healthy, w._policy_version, w._accepting = new
            return True
        was_healthy = w.state.healthy
        self._leave(w)
        w.state.healthy, w._policy_version, w._accepting = new
        self._enter(w)
        if was_healthy != w.state.healthy:
            self._export()
        return True

    # --- changes ----------------------------------------------------------------------
    def add(self, worker_id: str, address: str, max_num_seqs: int, policy_version: int, vocab_size: int,
            max_model_len: int, *, draining: bool = False, polled: bool = False) -> tuple[WorkerHandle, bool]:
        """Registers a worker, or refreshes it (registration is its heartbeat): O(1).
        Returns it, and whether anything dispatch or readiness depends on changed."""
        w = self.workers.get(worker_id)
        changed = w is None or w.address != address
        if changed:
            if w is not None:
                self.remove(worker_id)
            w = self.workers[worker_id] = WorkerHandle(
                worker_id, address, WorkerState(worker_id=worker_id, capacity=max_num_seqs), policy_version,
                polled=polled)
            w.state.healthy = False  # entered healthy below, counted once
            self._enter(w)
            log.info("worker %s at %s registered (capacity %d)", worker_id, address, max_num_seqs)
        elif not w.state.healthy:
            log.info("worker %s is back", worker_id)
        changed |= w.state.capacity != max_num_seqs
        w.state.capacity, w.vocab_size, w.max_model_len = max_num_seqs, vocab_size, max_model_len
        w.polled = polled
        changed |= self._update(w, healthy=True, version=policy_version, accepting=not draining)
        self.seen(w)
        return w, changed

    def seen(self, w: WorkerHandle) -> None:
        """A sign of life: a beat (or an answered poll)."""
        w.last_seen, w.last_heard = time.monotonic(), self.heard_clock
        self.beats += 1
        if w.polled:
            self._by_beat.pop(w.worker_id, None)
        else:
            self._by_beat[w.worker_id] = w
            self._by_beat.move_to_end(w.worker_id)

    def mark_unhealthy(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None and w.state.healthy:
            log.warning("worker %s marked unhealthy", worker_id)
            self._update(w, healthy=False)

    def mark_healthy(self, w: WorkerHandle, policy_version: int, accepting: bool) -> None:
        """A static worker answered its poll."""
        if not w.state.healthy:
            log.info("worker %s healthy again", w.worker_id)
        self._update(w, healthy=True, version=policy_version, accepting=accepting)
        self.seen(w)

    def set_version(self, w: WorkerHandle, version: int) -> None:
        """It loaded ``version`` (a push, a catch-up)."""
        self._update(w, version=version)

    def stop_accepting(self, w: WorkerHandle) -> None:
        """It drains: no new work; its running chunks finish and report."""
        self._update(w, accepting=False)

    def remove(self, worker_id: str) -> WorkerHandle | None:
        w = self.workers.pop(worker_id, None)
        if w is not None:
            self._leave(w)
            self.draining.pop(worker_id, None)
            self._by_beat.pop(worker_id, None)
            self._export()
        return w

    # --- questions ----------------------------------------------------------------------
    def silent(self, since: float) -> list[WorkerHandle]:
        """Registered workers not heard from since ``since`` (on the heard clock): O(their
        number), never O(fleet)."""
        out = []
        for w in self._by_beat.values():
            if w.last_heard >= since:
                break
            out.append(w)
        return out

    @property
    def num_healthy(self) -> int:
        return self._healthy

    def polled_workers(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.polled]

    def any_serving(self, policy_version: int) -> bool:
        """Whether some worker may get chunks of ``policy_version``: O(1)."""
        return self._usable[policy_version] > 0

    def usable(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.can_take_work]

    def serving(self, policy_version: int) -> list[WorkerHandle]:
        """The workers that may get chunks: usable and on ``policy_version`` (do not
        change the list). Kept until a worker changes (every change passes ``_leave`` /
        ``_enter``): the dispatcher asks after every batch of results, and a scan of the
        fleet each time cost O(W) per batch."""
        if self._serving is None or self._serving[0] != policy_version:
            self._serving = (policy_version, [w for w in self.workers.values()
                                              if w.can_take_work and w.policy_version == policy_version])
        return self._serving[1]

    def _export(self) -> None:
        metrics.workers_registered.labels(healthy="true").set(self._healthy)
        metrics.workers_registered.labels(healthy="false").set(len(self.workers) - self._healthy)
