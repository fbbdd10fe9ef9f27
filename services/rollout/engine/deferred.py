"""Work handed to the engine thread that no step waits for, run where it delays none.

A worker's drafter takes every finished sample and, at each new step, the history
service's stream of recent responses into its global index (services/rollout/global_feed.py).
Those inserts cost about a microsecond a token in the compiled core (several in the
Python reference): a step's stream of 131,072 tokens is over 0.1 s of host time. Run
between two steps, they hold the next forward back that long; ``LLMEngine.defer`` runs
them instead right after a forward's launch, beside the step's other deferred work
(the metric exports, block hashing), while the device computes, and paces them: at most
``budget`` cost units a step (for the feed, tokens), so no step's host work grows by more
than that. They run in the order given, and at once when the engine is idle.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class DeferredCalls:
    """Calls queued with a cost, run in order by ``run``, within a budget per run."""

    def __init__(self) -> None:
        self._calls: deque[tuple[Callable[[], object], int]] = deque()

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, fn: Callable[[], object], cost: int = 0) -> None:
        """Queues ``fn`` (it must not need its result at once: it runs later, on this
        thread); ``cost``: its share of a run's budget (>= 0)."""
        if cost < 0:
            raise ValueError(f"cost: {cost} is negative")
        self._calls.append((fn, cost))

    def run(self, budget: int | None = None) -> int:
        """Runs queued calls in order while their costs fit ``budget`` (the first always
        runs, however costly: a call is never split); None: all of them. A call that
        raises is logged and dropped: it never fails the step that runs it. Returns how
        many ran."""
        calls = self._calls
        spent = ran = 0
        while calls:
            fn, cost = calls[0]
            if budget is not None and ran and spent + cost > budget:
                break
            calls.popleft()
            spent += cost
            ran += 1
            try:
                fn()
            except Exception:  # noqa: BLE001 - deferred work must not fail a step
                log.exception("a deferred call failed")
        return ran
