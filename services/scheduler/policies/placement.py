"""Least-loaded worker choice with cache affinity, for one ``schedule()`` call."""

from __future__ import annotations

import heapq

from services.scheduler.policies.base import WorkerState


class LeastLoaded:
    """The healthy workers with free capacity, cheapest first by in-flight count.

    Args:
        workers: the caller's workers; loads count what this call already placed.
        affinity_slack: a request stays on its previous worker (its KV/prefix cache is
            there) unless that worker runs more than this many requests beyond the
            least-loaded one (Seer uses 32).
    """

    def __init__(self, workers: list[WorkerState], affinity_slack: int = 32) -> None:
        self.affinity_slack = affinity_slack
        self._load: dict[str, int] = {}
        self._free: dict[str, int] = {}
        self._workers: dict[str, WorkerState] = {}
        self._order: dict[str, int] = {}  # ties go to the caller's worker order
        self._heap: list[tuple[int, int, str]] = []  # (load, order, worker_id), lazily stale
        for order, worker in enumerate(workers):  # inlined WorkerState.free: this loop is hot
            load = len(worker.running)
            if worker.healthy and load < worker.capacity:
                wid = worker.worker_id
                self._workers[wid], self._order[wid] = worker, order
                self._load[wid], self._free[wid] = load, worker.capacity - load
                self._heap.append((load, order, wid))
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._free)

    def num_free(self) -> int:
        return sum(self._free.values())

    def min_load(self) -> int | None:
        self._drop_stale()
        return self._heap[0][0] if self._heap else None

    def load_of(self, worker_id: str) -> int | None:
        """In-flight count of ``worker_id``, or None when it has no free slot."""
        return self._load[worker_id] if worker_id in self._free else None

    def take(self, preferred: str | None = None) -> WorkerState | None:
        """Book one slot: on ``preferred`` if affinity allows, else on the least loaded."""
        self._drop_stale()
        if not self._heap:
            return None
        wid = self._heap[0][2]
        if (preferred is not None and preferred in self._free
                and self._load[preferred] - self._heap[0][0] <= self.affinity_slack):
            wid = preferred
        return self._book(wid)

    def take_worker(self, worker_id: str) -> WorkerState | None:
        """Book one slot on exactly ``worker_id``, or None when it has none free."""
        if worker_id not in self._free:
            return None
        return self._book(worker_id)

    def _book(self, wid: str) -> WorkerState:
        self._load[wid] += 1
        self._free[wid] -= 1
        if self._free[wid] == 0:
            del self._free[wid]
        else:
            heapq.heappush(self._heap, (self._load[wid], self._order[wid], wid))
        return self._workers[wid]

    def _drop_stale(self) -> None:
        heap = self._heap
        while heap:
            load, _, wid = heap[0]
            if wid in self._free and self._load[wid] == load:
                return
            heapq.heappop(heap)
