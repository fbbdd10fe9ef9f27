"""Priority queues of requests whose keys may change (lazy-deletion binary heaps).

``RequestQueue`` orders requests by key; ``StepQueues`` keeps one per step and pops the
smallest head among the steps a ``StepQuota`` allows, so a policy's order holds within
the fair share the caller gives each step.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from services.scheduler.policies.base import Request, RequestKey, StepQuota


class RequestQueue:
    """Requests ordered by key, smallest first; push, re-key, remove and pop in O(log n).

    A re-keyed or removed request leaves a stale heap entry behind; entries are
    recognised as stale by their sequence number and skipped on pop.

    Args:
        seq: the counter that breaks ties between equal keys (shared by queues whose
            heads are compared, so ties go to the earlier push across all of them).
    """

    def __init__(self, seq: Iterator[int] | None = None) -> None:
        self._heap: list[tuple[Any, int, Request]] = []
        self._live: dict[RequestKey, tuple[Any, int, Request]] = {}  # request key -> its current entry
        self._seq = seq if seq is not None else itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request: Request) -> bool:
        return request.key in self._live

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in list(self._live.values()))

    def push(self, request: Request, key: Any) -> None:
        """Insert ``request``, or move it to ``key`` if it is already queued."""
        entry = (key, next(self._seq), request)
        self._live[request.key] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = sorted(self._live.values(), key=lambda e: (e[0], e[1]))

    def key_of(self, request: Request) -> Any:
        return self._live[request.key][0]

    def remove(self, request: Request) -> bool:
        return self._live.pop(request.key, None) is not None

    def head(self) -> tuple[Any, int] | None:
        """(key, sequence number) of the request ``pop`` would return next."""
        self._drop_stale()
        return self._heap[0][:2] if self._heap else None

    def peek(self) -> Request | None:
        self._drop_stale()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request | None:
        self._drop_stale()
        if not self._heap:
            return None
        _, _, request = heapq.heappop(self._heap)
        del self._live[request.key]
        return request

    def remove_where(self, predicate: Callable[[Request], bool]) -> list[Request]:
        removed = [entry[2] for entry in self._live.values() if predicate(entry[2])]
        for request in removed:
            del self._live[request.key]
        return removed

    def entries(self) -> list[tuple[Any, int, Request]]:
        """(key, sequence number, request) of every queued request, unordered."""
        return list(self._live.values())

    def _drop_stale(self) -> None:
        heap, live = self._heap, self._live
        while heap:
            _, seq, request = heap[0]
            entry = live.get(request.key)
            if entry is not None and entry[1] == seq:
                return
            heapq.heappop(heap)


class StepQueues:
    """One RequestQueue per step; ``pop`` takes the smallest head among allowed steps.

    Without a quota it pops exactly what one RequestQueue holding every request would;
    popping costs O(number of steps queued) more, and cancelling a step is O(its size).
    """

    def __init__(self) -> None:
        self._by_step: dict[str, RequestQueue] = {}
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, request: Request) -> bool:
        queue = self._by_step.get(request.step_id)
        return queue is not None and request in queue

    def __iter__(self) -> Iterator[Request]:
        return itertools.chain.from_iterable(list(self._by_step.values()))

    def push(self, request: Request, key: Any) -> None:
        queue = self._by_step.get(request.step_id)
        if queue is None:
            queue = self._by_step[request.step_id] = RequestQueue(self._seq)
        fresh = request not in queue
        queue.push(request, key)
        self._len += fresh

    def remove(self, request: Request) -> bool:
        queue = self._by_step.get(request.step_id)
        if queue is None or not queue.remove(request):
            return False
        self._len -= 1
        if not queue:
            del self._by_step[request.step_id]
        return True

    def pop(self, quota: StepQuota | None = None) -> Request | None:
        """The smallest-keyed request of a step ``quota`` allows (it takes one of that
        step's allowance); None when no allowed step has one queued."""
        if len(self._by_step) == 1 and quota is None:  # one step queued (the usual case): its head
            best = next(iter(self._by_step.values()))
        else:
            best = self._smallest_head(quota)
        request = best.pop() if best is not None else None
        if request is None:
            return None
        self._len -= 1
        if not best:
            del self._by_step[request.step_id]
        if quota is not None:
            quota.take(request.step_id)
        return request

    def _smallest_head(self, quota: StepQuota | None) -> RequestQueue | None:
        best, best_head = None, None
        for step_id, queue in self._by_step.items():
            if quota is not None and not quota.allows(step_id):
                continue
            head = queue.head()
            if head is not None and (best_head is None or head < best_head):
                best, best_head = queue, head
        return best

    def remove_step(self, step_id: str) -> list[Request]:
        queue = self._by_step.pop(step_id, None)
        removed = list(queue) if queue is not None else []
        self._len -= len(removed)
        return removed

    def in_order(self) -> list[Request]:
        """Every queued request, in pop order (no quota)."""
        entries = [entry for queue in self._by_step.values() for entry in queue.entries()]
        return [entry[2] for entry in sorted(entries, key=lambda e: (e[0], e[1]))]
