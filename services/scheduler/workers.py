"""The scheduler's table of rollout workers: who is registered, healthy, on which version.

Knows no gRPC (the channels are the worker link's); what it holds is what the core
dispatches by and what readiness reports.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from services.common import metrics
from services.scheduler.policies.base import WorkerState

log = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    worker_id: str
    address: str
    state: WorkerState
    policy_version: int = 0
    vocab_size: int = 0
    max_model_len: int = 0
    accepting: bool = True
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def can_take_work(self) -> bool:
        return self.state.healthy and self.accepting


class WorkerTable:
    """Workers known to the scheduler, by id."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerHandle] = {}

    def add(self, worker_id: str, address: str, max_num_seqs: int, policy_version: int,
            vocab_size: int, max_model_len: int) -> WorkerHandle:
        """Registers a worker, or refreshes it (registration is its heartbeat)."""
        w = self.workers.get(worker_id)
        if w is None or w.address != address:
            w = self.workers[worker_id] = WorkerHandle(
                worker_id, address, WorkerState(worker_id=worker_id, capacity=max_num_seqs))
            log.info("worker %s at %s registered (capacity %d)", worker_id, address, max_num_seqs)
        elif not w.state.healthy:
            log.info("worker %s is back", worker_id)
        w.state.healthy, w.accepting, w.last_seen = True, True, time.monotonic()
        w.state.capacity, w.policy_version = max_num_seqs, policy_version
        w.vocab_size, w.max_model_len = vocab_size, max_model_len
        self._export()
        return w

    def usable(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.can_take_work]

    def serving(self, policy_version: int) -> list[WorkerHandle]:
        """The workers that may get chunks: usable and on ``policy_version``."""
        return [w for w in self.workers.values() if w.can_take_work and w.policy_version == policy_version]

    def mark_unhealthy(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None and w.state.healthy:
            log.warning("worker %s marked unhealthy", worker_id)
            w.state.healthy = False
            self._export()

    def mark_healthy(self, w: WorkerHandle, policy_version: int, accepting: bool) -> None:
        w.last_seen, w.policy_version, w.accepting = time.monotonic(), policy_version, accepting
        if not w.state.healthy:
            log.info("worker %s healthy again", w.worker_id)
            w.state.healthy = True
            self._export()

    def remove(self, worker_id: str) -> WorkerHandle | None:
        w = self.workers.pop(worker_id, None)
        if w is not None:
            self._export()
        return w

    def _export(self) -> None:
        healthy = sum(w.state.healthy for w in self.workers.values())
        metrics.workers_registered.labels(healthy="true").set(healthy)
        metrics.workers_registered.labels(healthy="false").set(len(self.workers) - healthy)
