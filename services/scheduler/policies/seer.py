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

from collections.abc import Iterator
from typing import ClassVar

from services.scheduler.length_model import LengthModel
from services.scheduler.policies.base import (
    Assignment,
    Policy,
    Request,
    RequestKey,
    StepQuota,
    WorkerState,
    chunk_budget,
)
from services.scheduler.policies.placement import LeastLoaded
from services.scheduler.policies.queue import StepQueues
from services.scheduler.policies.steps import StepBook

# Re-keying a group costs O(its queued requests). Done on every sibling event, a group
# of n costs O(n^2) (a 4,096-sample group: seconds per step of the event loop). Past this
# many queued, a group is re-keyed once per (queued / REKEY_BATCH) events: O(n) amortised,
# with its order at most that many events stale; smaller groups stay exact.
REKEY_BATCH = 64


class SeerPolicy(Policy):
    name = "seer"
    use_history: ClassVar[bool] = False

    def __init__(self, chunk_size: int = 2048, affinity_slack: int = 32) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.affinity_slack = affinity_slack
        self._probes = StepQueues()  # key: (num_generated, arrival)
        self._rest = StepQueues()  # key: (-predicted_len, -num_generated, arrival)
        self._queued: dict[tuple[str, str], dict[RequestKey, Request]] = {}  # group -> its queued requests
        self._stale: dict[tuple[str, str], int] = {}  # group -> events since it was last re-keyed
        self._steps = StepBook()
        self._lengths = LengthModel()

    # --- events -------------------------------------------------------------------
    def add_step(self, requests: list[Request], lengths: LengthModel, now: float) -> None:
        """The step in one slice (RhymeRL's ``add_step_in_slices`` included)."""
        for _ in self.add_step_in_slices(requests, lengths, now, max(1, len(requests))):
            pass

    def add_step_in_slices(self, requests: list[Request], lengths: LengthModel, now: float,
                           slice_size: int) -> Iterator[int]:
        """The step is booked and its probes chosen whole; requests are predicted and
        queued a slice at a time."""
        self._lengths = lengths
        self._steps.add(requests)  # the whole step: it is unfinished until every request is done
        first_of_group: dict[tuple[str, str], Request] = {}
        for request in requests:
            first = first_of_group.get(request.group_id)
            if first is None or request.sample_index < first.sample_index:
                first_of_group[request.group_id] = request
        for request in first_of_group.values():
            request.is_probe = self._wants_probe(request)
        if len(requests) > slice_size:
            yield 0  # booking a huge step takes about a slice's time
        for start in range(0, len(requests), slice_size):
            for request in requests[start:start + slice_size]:
                self._enqueue(request)
            yield min(len(requests), start + slice_size)

    def schedule(self, workers: list[WorkerState], now: float,
                 quota: StepQuota | None = None) -> list[Assignment]:
        if not self.num_queued():
            return []
        free = LeastLoaded(workers, self.affinity_slack)
        assignments = []
        while free:
            request = self._pop(quota)
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
        removed = self._probes.remove_step(step_id) + self._rest.remove_step(step_id)
        for request in removed:
            self._queued.pop(request.group_id, None)
            self._stale.pop(request.group_id, None)
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
        self._queued.setdefault(request.group_id, {})[request.key] = request

    def _pop(self, quota: StepQuota | None = None) -> Request | None:
        request = self._probes.pop(quota)
        if request is None:
            request = self._rest.pop(quota)
        if request is not None:
            group_id = request.group_id
            group = self._queued[group_id]
            del group[request.key]
            if not group:
                del self._queued[group_id]
                self._stale.pop(group_id, None)
        return request

    def _rekey_group(self, group_id: tuple[str, str]) -> None:
        """A sibling finished or ran further: the group's estimate (and probe tier) changed."""
        queued = self._queued.get(group_id)
        if not queued:
            return
        stale = self._stale.get(group_id, 0) + 1
        if stale * REKEY_BATCH < len(queued):
            self._stale[group_id] = stale
            return
        self._stale.pop(group_id, None)
        for request in list(queued.values()):
            if not self._probes.remove(request):
                self._rest.remove(request)
            self._enqueue(request)
