"""The steps a scheduler holds in memory: every unfinished one, and finished ones while
they fit.

Finished steps are kept for idempotent re-submission, bounded by count and by the size
of their logs (the samples' tokens); the oldest go first. A re-submission of a dropped
step is answered from the step log in Redis instead (``step_log.py``).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator

from services.scheduler.step import StepRun


class StepTable:
    def __init__(self, max_retained: int = 64, max_retained_bytes: int = 512 << 20):
        self.max_retained = max_retained
        self.max_retained_bytes = max_retained_bytes
        self._steps: OrderedDict[str, StepRun] = OrderedDict()
        self._opening: dict[str, asyncio.Task] = {}

    def get(self, step_id: str) -> StepRun | None:
        return self._steps.get(step_id)

    def __contains__(self, step_id: str) -> bool:
        return step_id in self._steps

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[StepRun]:
        return iter(list(self._steps.values()))

    async def open(self, step_id: str, make: Callable[[], Awaitable[StepRun]]) -> StepRun:
        """Runs ``make`` once per step id however many submissions race (five trainers
        sending the same new step together get one StepRun). ``make`` runs as its own
        task: a caller that gives up does not cancel it for the others."""
        task = self._opening.get(step_id)
        if task is None:
            task = self._opening[step_id] = asyncio.ensure_future(make())
            task.add_done_callback(lambda _: self._opening.pop(step_id, None))
        return await asyncio.shield(task)

    def add(self, run: StepRun) -> None:
        self._steps[run.step_id] = run
        self.evict()

    def evict(self) -> None:
        """Drops the oldest finished steps beyond the count and size limits."""
        finished = [r for r in self._steps.values() if r.is_finished]
        num_bytes = sum(r.num_bytes for r in finished)
        excess = len(self._steps) - self.max_retained
        for run in finished:
            if excess <= 0 and num_bytes <= self.max_retained_bytes:
                break
            del self._steps[run.step_id]
            excess -= 1
            num_bytes -= run.num_bytes
