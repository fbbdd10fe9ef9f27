"""The discrete-event loop: simulated workers, real Policy objects, real StepTimelines.

One run, as numbered steps:
  1. release the first step: load its history into the length model, ``add_step``;
  2. ``schedule``; admit each assignment on its simulated worker (prefill stall; a
     migration re-prefills prompt + generated tokens) and push the worker's next event;
  3. pop the earliest worker event, and every other within ``quantum_s`` of it (one
     ``schedule`` call per batch of events keeps 4,096 workers fast; the live scheduler
     calls it per event, a difference of at most ``quantum_s`` per admission);
  4. for each chunk that ended: ``on_chunk_done``; a finished sample goes to its step's
     timeline; a step's last sample closes its timeline and bumps the policy version;
  5. release the next step: in ``sync`` mode when the previous one finished; in
     ``overlap`` mode (bounded staleness 1) as soon as the queue is empty while slots
     are free, so the next step's head fills the previous step's tail;
  6. back to 2 until no step and no event is left.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from services.common.cost_curve import CostCurve
from services.scheduler.length_model import LengthModel
from services.scheduler.policies.base import Policy, WorkerState
from services.scheduler.simulator.worker import Chunk, SimWorker, SpecConfig, SpeedCurve
from services.scheduler.simulator.workload import SimStep
from services.scheduler.timeline import StepStats, StepTimeline


@dataclass
class RunResult:
    policy: str
    steps: list[StepStats]
    total_s: float  # first dispatch to last result, all steps
    fleet: StepStats  # the whole run as one timeline (bubble over all steps)
    num_chunks: int = 0
    num_migrations: int = 0
    reprefill_tokens: int = 0
    num_mixed_version: int = 0  # samples whose tokens span two policy versions
    num_stale_start: int = 0  # samples begun before the policy of their step existed
    num_events: int = 0
    wall_s: float = 0.0
    predicted: list[float] = field(default_factory=list)  # at add_step, every sample
    actual: list[int] = field(default_factory=list)


class Simulator:
    """Drives one Policy over simulated workers.

    Args:
        policy: any Policy (the same objects the live scheduler runs).
        cost: forward time by tokens per forward.
        num_workers, capacity: the fleet; capacity = most sequences a worker runs at once.
        spec: speculative decoding model, or None for plain decoding.
        quantum_s: events this close together share one ``schedule`` call.
        overlap: release the next step into the previous step's tail (cross-step mode).
    """

    def __init__(self, policy: Policy, cost: CostCurve, num_workers: int, capacity: int,
                 spec: SpecConfig | None = None, quantum_s: float = 0.1, overlap: bool = False) -> None:
        self.policy, self.quantum_s, self.overlap = policy, quantum_s, overlap
        speed = SpeedCurve(cost, spec)
        self.workers = [SimWorker(WorkerState(f"w{i}", capacity), speed) for i in range(num_workers)]
        self.states = [w.state for w in self.workers]
        self._index = {w.worker_id: i for i, w in enumerate(self.workers)}
        self._events: list[tuple[float, int, int, int]] = []  # (time, seq, worker index, worker version)
        self._seq = itertools.count()

    def run(self, steps: list[SimStep], lengths: LengthModel) -> RunResult:
        wall = time.perf_counter()
        worker_ids = [w.worker_id for w in self.workers]
        self._pending = deque(steps)
        self._true_len: dict[str, int] = {}
        self._num_left: dict[str, int] = {}
        self._timelines: dict[str, StepTimeline] = {}
        self._start_version: dict[str, int] = {}
        self._version = 0  # bumps when a step finishes (the trainer's update)
        self._own_version: dict[str, int] = {}  # step -> the version its samples should use
        self._num_released = 0
        self._lengths = lengths
        self._fleet = StepTimeline("run", worker_ids)
        self.result = RunResult(self.policy.name, [], 0.0, self._fleet.finish(0.0))
        now = 0.0
        self._release(now)
        self._schedule(now)
        while self._events or self._pending:
            if not self._events:  # nothing running: release the next step (sync mode)
                if not self._release(now) and not self.policy.num_queued():
                    raise RuntimeError("simulation stalled: steps pending but none can start")
                if not self._schedule(now):
                    raise RuntimeError(f"{self.policy.name} left {self.policy.num_queued()} "
                                       "requests queued on an idle fleet")
                continue
            now = self._process_batch()
            if self._pending and (not self._num_left or (self.overlap and self._can_overlap())):
                self._release(now)
            self._schedule(now)
        self.result.fleet = self._fleet.finish(now)
        self.result.total_s = self.result.fleet.makespan_s
        self.result.wall_s = time.perf_counter() - wall
        return self.result

    # --- steps ----------------------------------------------------------------------
    def _release(self, now: float) -> bool:
        if not self._pending or len(self._num_left) >= 2:
            return False
        step = self._pending.popleft()
        self._own_version[step.step_id] = self._num_released
        self._num_released += 1
        self._true_len.update(step.true_len)
        self._num_left[step.step_id] = len(step.requests)
        timeline = self._timelines[step.step_id] = StepTimeline(step.step_id, [w.worker_id for w in self.workers])
        for worker in self.workers:
            if worker.chunks:
                timeline.on_worker_busy(worker.worker_id, True, now)
        self._lengths.load_history(step.history)
        self.policy.add_step(step.requests, self._lengths, now)
        for request in step.requests:
            self.result.predicted.append(float(request.predicted_len))
            self.result.actual.append(step.true_len[request.key])
        return True

    def _can_overlap(self) -> bool:
        return len(self._num_left) < 2 and self.policy.num_queued() == 0 and any(
            s.free for s in self.states)

    # --- events ---------------------------------------------------------------------
    def _process_batch(self) -> float:
        first = self._events[0][0]
        now = first
        while self._events and self._events[0][0] <= first + self.quantum_s:
            at, _, index, version = heapq.heappop(self._events)
            worker = self.workers[index]
            if version != worker.version:
                continue
            now = at
            self.result.num_events += 1
            for chunk in worker.pop_done(at):
                self._chunk_done(worker, chunk, at)
            if not worker.chunks:
                self._set_busy(worker, False, at)
            self._push(index)
        return now

    def _chunk_done(self, worker: SimWorker, chunk: Chunk, now: float) -> None:
        request = chunk.request
        finished = request.num_generated + chunk.num_tokens >= self._true_len[request.key]
        self.policy.on_chunk_done(request, worker.worker_id, chunk.num_tokens, finished, now)
        if not finished:
            return
        step_id = request.step_id
        self._timelines[step_id].on_sample_done(now)
        self._fleet.on_sample_done(now)
        started = self._start_version.pop(request.key)
        self.result.num_mixed_version += int(started != self._version)
        self.result.num_stale_start += int(started < self._own_version[step_id])
        self._num_left[step_id] -= 1
        if not self._num_left[step_id]:
            del self._num_left[step_id]
            self.result.steps.append(self._timelines.pop(step_id).finish(now))
            self._version += 1  # the trainer updates the policy with this step

    def _schedule(self, now: float) -> bool:
        """Returns whether anything was admitted."""
        if not self.policy.num_queued():
            return False
        touched = set()
        for assignment in self.policy.schedule(self.states, now):
            request = assignment.request
            index = self._index[assignment.worker_id]
            worker = self.workers[index]
            num_tokens = min(assignment.max_new_tokens,
                             self._true_len[request.key] - request.num_generated)
            if not worker.chunks:
                self._set_busy(worker, True, now)
            worker.admit(request, assignment.max_new_tokens, num_tokens, assignment.is_migration, now)
            self._start_version.setdefault(request.key, self._version)
            timeline = self._timelines[request.step_id]
            timeline.on_dispatch(worker.worker_id, now)
            self._fleet.on_dispatch(worker.worker_id, now)
            self.result.num_chunks += 1
            if assignment.is_migration:
                timeline.on_migration()
                self._fleet.on_migration()
                self.result.num_migrations += 1
                self.result.reprefill_tokens += request.prompt_len + request.num_generated
            touched.add(index)
        for index in touched:
            self._push(index)
        return bool(touched)

    def _push(self, index: int) -> None:
        worker = self.workers[index]
        at = worker.next_event_s()
        if at is not None:
            heapq.heappush(self._events, (at, next(self._seq), index, worker.version))

    def _set_busy(self, worker: SimWorker, busy: bool, now: float) -> None:
        self._fleet.on_worker_busy(worker.worker_id, busy, now)
        for timeline in self._timelines.values():
            timeline.on_worker_busy(worker.worker_id, busy, now)
