"""``static``: the RL-framework baseline (veRL-style even split, no chunks).

Each prompt's group is pinned round-robin to a worker when first seen, and its samples
run there whole (``max_new_tokens`` = everything they have left), in arrival order.
That is how RL frameworks split a step: veRL repeats each prompt n times next to each
other and cuts the batch into equal contiguous pieces per rollout worker (or asks one
engine for n samples), so a group stays on one worker, and its samples, whose lengths
are alike, pile up there (Seer's observation). An idle worker never takes another
worker's queue: this is the placement whose long tail the other policies remove. Only
a lost worker's requests are pinned again, to the survivors.
"""

from __future__ import annotations

import itertools
from collections import deque

from services.scheduler.length_model import LengthModel
from services.scheduler.policies.base import Assignment, Policy, Request, RequestKey, StepQuota, WorkerState
from services.scheduler.policies.queue import StepQueues
from services.scheduler.policies.steps import StepBook


class StaticPolicy(Policy):
    name = "static"

    def __init__(self) -> None:
        self._unpinned: deque[Request] = deque()  # arrived, no worker chosen yet
        self._pinned: dict[str, StepQueues] = {}  # worker_id -> its FIFO queue (per step, for quotas)
        self._back = itertools.count()  # FIFO keys: appended requests count up,
        self._front = itertools.count(-1, -1)  # requests put back in front count down
        self._cursor = 0  # round-robin position
        self._group_worker: dict[tuple[str, str], str] = {}  # group -> the worker it is pinned to
        self._lengths: LengthModel | None = None
        self._steps = StepBook()
        self._running: set[RequestKey] = set()  # dispatched, no result yet

    def add_step(self, requests: list[Request], lengths: LengthModel, now: float) -> None:
        self._lengths = lengths
        self._steps.add(requests)
        for request in requests:
            request.predicted_len = lengths.predict(request)
        self._unpinned.extend(requests)

    def schedule(self, workers: list[WorkerState], now: float,
                 quota: StepQuota | None = None) -> list[Assignment]:
        for worker in workers:
            if not worker.healthy and worker.worker_id in self._pinned:
                self._unpinned.extendleft(reversed(self._pinned.pop(worker.worker_id).in_order()))
        if self._unpinned:
            self._pin([w for w in workers if w.healthy])
        assignments = []
        for worker in workers:  # inlined WorkerState.free: this loop is hot
            num_free = worker.capacity - len(worker.running)
            if num_free <= 0 or not worker.healthy:
                continue
            queue = self._pinned.get(worker.worker_id)
            for _ in range(min(num_free, len(queue) if queue else 0)):
                request = queue.pop(quota)
                if request is None:
                    break
                self._running.add(request.key)
                assignments.append(self._assign(request, worker, request.num_remaining))
        return assignments

    def _pin(self, healthy: list[WorkerState]) -> None:
        if not healthy:
            return
        alive = {w.worker_id for w in healthy}
        while self._unpinned:
            request = self._unpinned.popleft()
            worker_id = self._group_worker.get(request.group_id)
            if worker_id not in alive:  # a new group, or its worker was lost
                worker_id = self._group_worker[request.group_id] = healthy[self._cursor % len(healthy)].worker_id
                self._cursor += 1
            self._pinned.setdefault(worker_id, StepQueues()).push(request, next(self._back))

    def on_chunk_done(self, request: Request, worker_id: str, num_new_tokens: int,
                      finished: bool, now: float) -> None:
        if request.key not in self._running or not self._steps.is_live(request):
            self._running.discard(request.key)  # a cancelled step, or a repeated result
            return
        self._running.discard(request.key)
        self._record_chunk(request, num_new_tokens)
        if finished:
            self._lengths.observe(request, request.num_generated)
            if self._steps.finish(request):
                self._forget(request.step_id)
        else:  # the engine stopped it early (e.g. preemption): resume where it ran
            self._pinned.setdefault(worker_id, StepQueues()).push(request, next(self._front))

    def on_worker_lost(self, worker_id: str, requests: list[Request], now: float) -> None:
        lost_queue = self._pinned.pop(worker_id, None)
        if lost_queue is not None:
            self._unpinned.extendleft(reversed(lost_queue.in_order()))
        live = [r for r in requests if r.key in self._running and self._steps.is_live(r)]
        self._running.difference_update(r.key for r in requests)
        self._unpinned.extendleft(reversed(live))  # the interrupted ones first

    def cancel_step(self, step_id: str) -> list[Request]:
        removed = [r for r in self._unpinned if r.step_id == step_id]
        self._unpinned = deque(r for r in self._unpinned if r.step_id != step_id)
        for queue in self._pinned.values():
            removed += queue.remove_step(step_id)
        self._steps.cancel(step_id)
        self._forget(step_id)
        return removed

    def _forget(self, step_id: str) -> None:
        if self._lengths is not None:
            self._lengths.forget_step(step_id)
        for group in [g for g in self._group_worker if g[0] == step_id]:
            del self._group_worker[group]

    def num_queued(self) -> int:
        return len(self._unpinned) + sum(map(len, self._pinned.values()))
