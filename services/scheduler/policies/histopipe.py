"""``histopipe``: RhymeRL's HistoPipe placement from historical lengths (arXiv 2508.18588).

1. Each request's length is predicted from its prompt's earlier epochs (``LengthModel``).
2. When a step's requests are first scheduled, they are placed longest-first, each on
   the worker whose estimated finish time is earliest (LPT). A worker's finish time
   comes from the cost model: with ``c`` slots and queued tokens ``Q`` of which the
   longest is ``L``, it needs max(Q / c, L) decode steps of ``forward(c)`` each. Long
   groups thus spread over more workers and completion times even out.
3. Each worker runs its own queue, longest predicted first, whole requests (no chunks).
Left out: HistoPipe's in-step migration of outgrowing rollouts (needs chunks: that
is what ``rhymerl`` adds) and its odd/even step order (``rhymerl``'s ``cross_step``).
"""

from __future__ import annotations

import heapq

from services.common.cost_curve import CostCurve
from services.scheduler.length_model import LengthModel
from services.scheduler.policies.base import Assignment, Policy, Request, RequestKey, StepQuota, WorkerState
from services.scheduler.policies.queue import StepQueues
from services.scheduler.policies.steps import StepBook


class HistoPipePolicy(Policy):
    name = "histopipe"

    def __init__(self, cost: CostCurve | None = None, model_shape: str = "7B") -> None:
        self.cost = cost or CostCurve.h100(model_shape)
        self._unplaced: list[Request] = []
        self._queues: dict[str, StepQueues] = {}  # worker_id -> key (-predicted_len, arrival)
        self._home: dict[RequestKey, str] = {}  # request -> worker whose queue holds it
        self._steps = StepBook()
        self._lengths = LengthModel()

    def add_step(self, requests: list[Request], lengths: LengthModel, now: float) -> None:
        self._lengths = lengths
        self._steps.add(requests)
        for request in requests:
            request.predicted_len = lengths.predict(request)
        self._unplaced.extend(requests)

    def schedule(self, workers: list[WorkerState], now: float,
                 quota: StepQuota | None = None) -> list[Assignment]:
        for worker in workers:
            if not worker.healthy and worker.worker_id in self._queues:
                self._unqueue_worker(worker.worker_id)
        if self._unplaced:
            self._place([w for w in workers if w.healthy])
        assignments = []
        for worker in workers:  # inlined WorkerState.free: this loop is hot
            num_free = worker.capacity - len(worker.running)
            queue = self._queues.get(worker.worker_id)
            while num_free > 0 and worker.healthy and queue:
                request = queue.pop(quota)
                if request is None:
                    break
                del self._home[request.key]
                assignments.append(self._assign(request, worker, request.num_remaining))
                num_free -= 1
        return assignments

    def on_chunk_done(self, request: Request, worker_id: str, num_new_tokens: int,
                      finished: bool, now: float) -> None:
        if not self._steps.accepts(request):  # a cancelled step, or a repeated result
            return
        self._record_chunk(request, num_new_tokens)
        if not finished:  # the engine stopped it early: resume on the same worker
            self._enqueue(request, worker_id)
            return
        self._lengths.observe(request, request.num_generated)
        if self._steps.finish(request):
            self._lengths.forget_step(request.step_id)

    def on_worker_lost(self, worker_id: str, requests: list[Request], now: float) -> None:
        self._unplaced.extend(r for r in requests if self._steps.is_live(r))
        self._unqueue_worker(worker_id)

    def _unqueue_worker(self, worker_id: str) -> None:
        """Move a lost worker's queue back to the unplaced requests."""
        for request in self._queues.pop(worker_id, ()):
            del self._home[request.key]
            self._unplaced.append(request)

    def cancel_step(self, step_id: str) -> list[Request]:
        removed = [r for r in self._unplaced if r.step_id == step_id]
        self._unplaced = [r for r in self._unplaced if r.step_id != step_id]
        for queue in self._queues.values():
            removed += queue.remove_step(step_id)
        for request in removed:
            self._home.pop(request.key, None)
        self._steps.cancel(step_id)
        self._lengths.forget_step(step_id)
        return removed

    def num_queued(self) -> int:
        return len(self._unplaced) + len(self._home)

    # --- placement ----------------------------------------------------------------
    def finish_estimate_s(self, capacity: int, tokens: float, longest: float) -> float:
        """Time a worker with ``capacity`` slots needs for ``tokens`` (longest ``longest``)."""
        return self.cost.forward_s(capacity) * max(tokens / capacity, longest)

    def _place(self, healthy: list[WorkerState]) -> None:
        """LPT: longest request first onto the worker that would finish earliest."""
        if not healthy:
            return
        tokens, longest = {}, {}
        for worker in healthy:
            wid = worker.worker_id
            remaining = [self._remaining(r) for r in worker.running.values()]
            remaining += [self._remaining(r) for r in self._queues.get(wid, ())]
            tokens[wid], longest[wid] = sum(remaining), max(remaining, default=0.0)
        capacity = {w.worker_id: max(1, w.capacity) for w in healthy}
        heap = [(self.finish_estimate_s(capacity[w.worker_id], tokens[w.worker_id], longest[w.worker_id]),
                 order, w.worker_id) for order, w in enumerate(healthy)]
        heapq.heapify(heap)
        for request in sorted(self._unplaced, key=lambda r: (-self._remaining(r), self._steps.arrival(r))):
            _, order, wid = heapq.heappop(heap)
            self._enqueue(request, wid)
            tokens[wid] += self._remaining(request)
            longest[wid] = max(longest[wid], self._remaining(request))
            heapq.heappush(heap, (self.finish_estimate_s(capacity[wid], tokens[wid], longest[wid]), order, wid))
        self._unplaced = []

    def _remaining(self, request: Request) -> float:
        return max(1.0, float(request.predicted_len or request.max_tokens) - request.num_generated)

    def _enqueue(self, request: Request, worker_id: str) -> None:
        request.predicted_len = self._lengths.predict(request)
        self._queues.setdefault(worker_id, StepQueues()).push(
            request, (-request.predicted_len, self._steps.arrival(request)))
        self._home[request.key] = worker_id
