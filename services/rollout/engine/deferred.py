"""Work handed to the engine thread that no step waits for, run where it delays none.

A worker's drafter takes every finished sample and, at each new step, the history
service's stream of recent responses into its global index (services/rollout/global_feed.py).
Those inserts take the compiled core under a microsecond a token (several in the Python
reference): a step's stream of 128,953 tokens took 49-68 ms of host time in
benchmarks/results/drafter_feed.md. Run between two steps, they hold the next forward
back that long; ``LLMEngine.defer`` runs
them instead right after a forward's launch, beside the step's other deferred work
(the metric exports, block hashing), while the device computes, and paces them: at most
``budget`` cost units a step (for the feed, tokens), so no step's host work grows by more
than that. They run in the order given, and at once when the engine is idle. An urgent
call (one a request waits for: a new prompt's earlier epochs loaded into the drafter
before its requests start, services/rollout/drafter_history.py) runs behind the very next
forward, ahead of the paced ones and whatever its cost: delaying it would only delay
those requests, and behind the forward it costs the batch nothing up to the forward's
duration, where between two steps the device waits for all of it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

# The cost deferred calls may spend behind one forward by default: for the drafter's feed,
# tokens inserted into its global index (under a microsecond each in the compiled core on
# this project's CPUs: at most a couple of milliseconds, under a decode forward of a real
# model; benchmarks/results/drafter_feed.md). RHYMERL_WORKER_FEED_TOKENS_PER_STEP sets it.
DEFERRED_COST_PER_STEP = 2048


class DeferredCalls:
    """Calls queued with a cost, run in order by ``run``: the urgent ones all, then the
    others within a budget per run."""

    def __init__(self) -> None:
        self._urgent: deque[Callable[[], object]] = deque()
        self._calls: deque[tuple[Callable[[], object], int]] = deque()

    def __len__(self) -> int:
        return len(self._urgent) + len(self._calls)

    def add(self, fn: Callable[[], object], cost: int = 0, urgent: bool = False) -> None:
        """Queues ``fn`` (it must not need its result at once: it runs later, on this
        thread); ``cost``: its share of a run's budget (>= 0); ``urgent``: it runs at the
        next ``run``, before the others, whatever the budget."""
        if cost < 0:
            raise ValueError(f"cost: {cost} is negative")
        if urgent:
            self._urgent.append(fn)
        else:
            self._calls.append((fn, cost))

    def run(self, budget: int | None = None) -> int:
        """Runs every urgent call, then the others in order while their costs fit
        ``budget`` (the first always runs, however costly: a call is never split); None:
        all of them. A call that raises is logged and dropped: it never fails the step
        that runs it. Returns how many ran."""
        ran = 0
        while self._urgent:
            _call(self._urgent.popleft())
            ran += 1
        calls = self._calls
        spent = paced = 0
        while calls:
            fn, cost = calls[0]
            if budget is not None and paced and spent + cost > budget:
                break
            calls.popleft()
            spent += cost
            paced += 1
            _call(fn)
        return ran + paced


def _call(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - deferred work must not fail a step
        log.exception("a deferred call failed")
