"""Per-step metrics: makespan, bubble ratio, tail time, busy seconds, migrations.

Fed the same events by the live scheduler and the simulator, so their numbers mean
the same thing. Definitions:
  - makespan: first dispatch to last sample result;
  - bubble ratio: idle worker-seconds / (num_workers x makespan), busy time clipped to
    the makespan window; every worker known to the step counts, including one that
    was lost during it (its lost capacity is idle capacity);
  - tail time (Seer): the last 10% of samples to finish (at least one); the time from
    the result just before them to the last result.
Knows nothing about policies or requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepStats:
    step_id: str
    num_workers: int
    num_samples: int
    start_s: float  # first dispatch
    end_s: float  # last result
    makespan_s: float
    bubble_ratio: float
    tail_time_s: float
    worker_busy_s: dict[str, float] = field(default_factory=dict)
    num_migrations: int = 0


class StepTimeline:
    def __init__(self, step_id: str, worker_ids: list[str]) -> None:
        self.step_id = step_id
        self._first_dispatch: float | None = None
        self._done_times: list[float] = []
        self._busy_since: dict[str, float | None] = {w: None for w in worker_ids}
        self._intervals: dict[str, list[tuple[float, float]]] = {w: [] for w in worker_ids}
        self.num_migrations = 0

    def add_worker(self, worker_id: str) -> None:
        if worker_id not in self._intervals:
            self._busy_since[worker_id] = None
            self._intervals[worker_id] = []

    def on_dispatch(self, worker_id: str, now: float) -> None:
        """A chunk of this step was sent to ``worker_id``."""
        self.add_worker(worker_id)
        if self._first_dispatch is None or now < self._first_dispatch:
            self._first_dispatch = now

    def on_worker_busy(self, worker_id: str, busy: bool, now: float) -> None:
        """``worker_id`` started (busy=True) or stopped having work; repeats are ignored."""
        self.add_worker(worker_id)
        since = self._busy_since[worker_id]
        if busy and since is None:
            self._busy_since[worker_id] = now
        elif not busy and since is not None:
            self._intervals[worker_id].append((since, now))
            self._busy_since[worker_id] = None

    def add_busy_interval(self, worker_id: str, start: float, end: float) -> None:
        self.add_worker(worker_id)
        self._intervals[worker_id].append((start, end))

    def on_sample_done(self, now: float) -> None:
        self._done_times.append(now)

    def on_migration(self, count: int = 1) -> None:
        self.num_migrations += count

    def finish(self, now: float) -> StepStats:
        """Close the step; open busy intervals end at the last result (or ``now``)."""
        start = self._first_dispatch if self._first_dispatch is not None else now
        done = sorted(self._done_times)
        end = done[-1] if done else now
        makespan = max(0.0, end - start)
        busy: dict[str, float] = {}
        for worker_id, intervals in self._intervals.items():
            since = self._busy_since[worker_id]
            spans = intervals + ([(since, max(since, end))] if since is not None else [])
            busy[worker_id] = sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)
        num_workers = len(busy)
        capacity = num_workers * makespan
        bubble = (capacity - sum(busy.values())) / capacity if capacity > 0 else 0.0
        num_tail = math.ceil(0.1 * len(done))
        if len(done) > num_tail:
            tail = end - done[len(done) - num_tail - 1]
        else:
            tail = makespan
        return StepStats(self.step_id, num_workers, len(done), start, end, makespan,
                         max(0.0, bubble), tail, busy, self.num_migrations)
