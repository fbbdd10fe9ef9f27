"""A priority queue of requests whose keys may change (lazy-deletion binary heap)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from services.scheduler.policies.base import Request


class RequestQueue:
    """Requests ordered by key, smallest first; push, re-key, remove and pop in O(log n).

    A re-keyed or removed request leaves a stale heap entry behind; entries are
    recognised as stale by their sequence number and skipped on pop.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[Any, int, Request]] = []
        self._live: dict[str, tuple[Any, int, Request]] = {}  # request_id -> its current entry
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, request: Request) -> bool:
        return request.request_id in self._live

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in list(self._live.values()))

    def push(self, request: Request, key: Any) -> None:
        """Insert ``request``, or move it to ``key`` if it is already queued."""
        entry = (key, next(self._seq), request)
        self._live[request.request_id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = sorted(self._live.values(), key=lambda e: (e[0], e[1]))

    def key_of(self, request: Request) -> Any:
        return self._live[request.request_id][0]

    def remove(self, request: Request) -> bool:
        return self._live.pop(request.request_id, None) is not None

    def peek(self) -> Request | None:
        self._drop_stale()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request | None:
        self._drop_stale()
        if not self._heap:
            return None
        _, _, request = heapq.heappop(self._heap)
        del self._live[request.request_id]
        return request

    def remove_where(self, predicate: Callable[[Request], bool]) -> list[Request]:
        removed = [entry[2] for entry in self._live.values() if predicate(entry[2])]
        for request in removed:
            del self._live[request.request_id]
        return removed

    def _drop_stale(self) -> None:
        heap, live = self._heap, self._live
        while heap:
            _, seq, request = heap[0]
            entry = live.get(request.request_id)
            if entry is not None and entry[1] == seq:
                return
            heapq.heappop(heap)
