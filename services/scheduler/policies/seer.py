"""``seer``: Seer's context-aware scheduling over divided rollout (arXiv 2511.14617).

1. Every group's first sample is a probe; probes of groups with no finished sample run
   first, the one with the fewest generated tokens first.
2. The rest run longest group estimate first; a group's estimate is its longest
   finished sample, ``max_tokens`` while none has finished (``LengthModel`` with
   ``use_history=False``); a request that outgrew its estimate counts as ``max_tokens``.
3. Requests run in chunks of at most ``chunk_size`` tokens; after each chunk the request
   returns to the pool and may resume on another worker.
4. A chunk goes to the least-loaded worker, or back to the request's previous worker
   (its prefix cache) while that one is within ``affinity_slack`` in-flight requests of
   the least loaded.
Left out: Seer's occasional picks from starved groups (a fairness device; not
modelled here) and its global KV pool (a migration here re-prefills instead).
"""

from __future__ import annotations

from typing import ClassVar

from services.scheduler.length_model import LengthModel
from services.scheduler.policies.base import (
    Assignment,
    Policy,
    Request,
    WorkerState,
    chunk_budget,
)
from services.scheduler.policies.placement import LeastLoaded
from services.scheduler.policies.queue import RequestQueue
from services.scheduler.policies.steps import StepBook


class SeerPolicy(Policy):
    name = "seer"
    use_history: ClassVar[bool] = False

    def __init__(self, chunk_size: int = 2048, affinity_slack: int = 32) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.affinity_slack = affinity_slack
        self._probes = RequestQueue()  # key: (num_generated, arrival)
        self._rest = RequestQueue()  # key: (-predicted_len, -num_generated, arrival)
        self._queued: dict[tuple[str, str], dict[str, Request]] = {}  # group -> its queued requests
        self._steps = StepBook()
        self._lengths = LengthModel()

    # --- events -------------------------------------------------------------------
    def add_step(self, requests: list[Request], lengths: LengthModel, now: float) -> None:
        self._lengths = lengths
        self._steps.add(requests)
        first_of_group: dict[tuple[str, str], Request] = {}
        for request in requests:
            first = first_of_group.get(request.group_id)
            if first is None or request.sample_index < first.sample_index:
                first_of_group[request.group_id] = request
        for request in first_of_group.values():
            request.is_probe = self._wants_probe(request)
        for request in requests:
            self._enqueue(request)

    def schedule(self, workers: list[WorkerState], now: float) -> list[Assignment]:
        if not self.num_queued():
            return []
        free = LeastLoaded(workers, self.affinity_slack)
        assignments = []
        while free:
            request = self._pop()
            if request is None:
                break
            worker = free.take(request.last_worker)
            assignments.append(self._assign(request, worker, self._budget(request)))
        return assignments

    def on_chunk_done(self, request: Request, worker_id: str, num_new_tokens: int,
                      finished: bool, now: float) -> None:
        if not self._steps.accepts(request):  # a cancelled step, or a repeated result
            return
        self._record_chunk(request, num_new_tokens)
        if not finished:
            if self._lengths.observe_progress(request) and self.use_history:
                self._rekey_group(request.group_id)  # its siblings' floor rose
            self._enqueue(request)
            return
        self._lengths.observe(request, request.num_generated)
        if self._steps.finish(request):
            self._lengths.forget_step(request.step_id)
        else:
            self._rekey_group(request.group_id)

    def on_worker_lost(self, worker_id: str, requests: list[Request], now: float) -> None:
        for request in requests:
            if self._steps.is_live(request):
                self._enqueue(request)

    def cancel_step(self, step_id: str) -> list[Request]:
        in_step = lambda r: r.step_id == step_id
        removed = self._probes.remove_where(in_step) + self._rest.remove_where(in_step)
        for group in [g for g in self._queued if g[0] == step_id]:
            del self._queued[group]
        self._steps.cancel(step_id)
        self._lengths.forget_step(step_id)
        return removed

    def num_queued(self) -> int:
        return len(self._probes) + len(self._rest)

    # --- hooks a subclass may change ------------------------------------------------
    def _wants_probe(self, request: Request) -> bool:
        """Whether a group's first request should run as a probe."""
        return True

    def _in_probe_tier(self, request: Request) -> bool:
        """Whether it queues with the probes (ahead of everything else)."""
        return request.is_probe and self._lengths.num_finished_siblings(request.group_id) == 0

    def _priority(self, request: Request) -> tuple:
        """Queue key of a non-probe request (smallest runs first)."""
        return (-request.predicted_len, -request.num_generated, self._steps.arrival(request))

    def _budget(self, request: Request) -> int:
        return chunk_budget(request, self.chunk_size)

    # --- the pool -------------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        request.predicted_len = self._lengths.predict(request, use_history=self.use_history)
        if self._in_probe_tier(request):
            self._probes.push(request, (request.num_generated, self._steps.arrival(request)))
        else:
            self._rest.push(request, self._priority(request))
        self._queued.setdefault(request.group_id, {})[request.request_id] = request

    def _pop(self) -> Request | None:
        request = self._probes.pop() if self._probes else self._rest.pop()
        if request is not None:
            group = self._queued[request.group_id]
            del group[request.request_id]
            if not group:
                del self._queued[request.group_id]
        return request

    def _rekey_group(self, group_id: tuple[str, str]) -> None:
        """A sibling finished: the group's estimate (and probe tier) changed."""
        for request in list(self._queued.get(group_id, {}).values()):
            if not self._probes.remove(request):
                self._rest.remove(request)
            self._enqueue(request)
