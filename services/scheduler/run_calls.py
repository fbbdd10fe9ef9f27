"""The Run calls in flight: chunks sent to a worker, their results applied to the samples,
their failures retried or given up.

Every chunk gets a dispatch id of its own. A sample's ``dispatch_id`` names its chunk in
flight; a result for any other id is stale (its worker was declared lost and the chunk
re-ran elsewhere) and is ignored, so a sample never takes a chunk's tokens twice.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections import defaultdict
from typing import TYPE_CHECKING

from rhymerl.v1 import common_pb2

from services.common import metrics
from services.scheduler.policies.base import Assignment, RequestKey
from services.scheduler.step import SampleProgress, StepRun
from services.scheduler.worker_link import Chunk, ChunkDone, ChunkFailed, RunEnded, RunOutcome
from services.scheduler.workers import WorkerHandle

if TYPE_CHECKING:
    from services.scheduler.core import SchedulerCore

log = logging.getLogger(__name__)
ABORT = common_pb2.FINISH_REASON_ABORT


class RunCalls:
    def __init__(self, core: SchedulerCore):
        self.core = core
        self.num_chunks = 0  # in flight, all workers
        self._no_chunks = asyncio.Event()
        self._no_chunks.set()
        self._dispatch_ids = itertools.count()
        self._incarnation = secrets.token_hex(4)  # dispatch ids never repeat across restarts
        self._by_worker: dict[str, set[asyncio.Task]] = defaultdict(set)

    async def drained(self) -> None:
        """Returns when no chunk is in flight."""
        await self._no_chunks.wait()

    def start(self, worker: WorkerHandle, assignments: list[Assignment], now: float) -> None:
        """Sends ``assignments`` to ``worker`` in one Run call (a task of its own)."""
        chunks = [self._chunk(worker, a, now) for a in assignments]
        pending = {c.dispatch_id: a for c, a in zip(chunks, assignments)}
        task = self.core.spawn(self._run(worker, pending, chunks))
        self._by_worker[worker.worker_id].add(task)
        task.add_done_callback(self._by_worker[worker.worker_id].discard)
        # cancelled before its first step (its worker lost at once), _run's finally never runs
        task.add_done_callback(lambda t: self._requeue(worker, pending) if t.cancelled() and pending else None)

    def worker_lost(self, worker: WorkerHandle) -> None:
        """Cancels ``worker``'s Run calls; their chunks are re-queued."""
        for task in list(self._by_worker.get(worker.worker_id, ())):
            task.cancel()

    def _chunk(self, worker: WorkerHandle, a: Assignment, now: float) -> Chunk:
        run, prog = self.core.unfinished[a.request.key]
        prog.dispatch_id = f"{self._incarnation}-{next(self._dispatch_ids)}"
        run.num_running += 1
        self.num_chunks += 1
        self._no_chunks.clear()
        timeline = self.core.delivery.timelines[run.step_id]
        if not worker.state.running:
            self.core.delivery.set_busy(worker.worker_id, True, now)
        worker.state.running[a.request.key] = a.request
        timeline.on_dispatch(worker.worker_id, now)
        if a.is_migration:
            timeline.on_migration()
            metrics.migrations_total.inc()
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(run.sampling)
        sampling.seed = prog.seed
        return Chunk(prog.dispatch_id, a.request.key, prog.prompt_token_ids, list(prog.token_ids), sampling,
                     a.max_new_tokens, run.n)

    async def _run(self, worker: WorkerHandle, pending: dict[str, Assignment], chunks: list[Chunk]) -> None:
        try:
            async for event in self.core.link.run(worker, self.core.policy_version, chunks):
                if isinstance(event, RunEnded):
                    await self._on_run_ended(worker, pending, event)
                    break
                a = pending.pop(event.dispatch_id, None)
                if a is None:
                    continue
                if isinstance(event, ChunkFailed):
                    await self._on_failed(worker, a, event.dispatch_id, f"worker {worker.worker_id}: {event.error}")
                else:
                    await self._on_chunk(worker, a, event)
        finally:
            self._requeue(worker, pending)

    def _current(self, key: RequestKey, dispatch_id: str) -> tuple[StepRun, SampleProgress] | None:
        """The sample, if ``dispatch_id`` is its chunk in flight (else the result is stale)."""
        entry = self.core.unfinished.get(key)
        return entry if entry is not None and entry[1].dispatch_id == dispatch_id else None

    def _release(self, worker: WorkerHandle, run: StepRun, prog: SampleProgress, now: float) -> None:
        worker.state.running.pop(prog.request.key, None)
        prog.dispatch_id = None
        run.num_running -= 1
        self.num_chunks -= 1
        if not self.num_chunks:
            self._no_chunks.set()
        if not worker.state.running:
            self.core.delivery.set_busy(worker.worker_id, False, now)

    async def _on_chunk(self, worker: WorkerHandle, a: Assignment, ev: ChunkDone) -> None:
        entry = self._current(a.request.key, ev.dispatch_id)
        if entry is None:
            return
        run, prog = entry
        r, now = a.request, time.monotonic()
        self._release(worker, run, prog, now)
        prog.token_ids.extend(ev.token_ids)
        prog.logprobs.extend(ev.logprobs)
        prog.token_versions.extend([ev.policy_version] * len(ev.token_ids))
        prog.num_verify_steps += ev.num_verify_steps
        prog.num_draft_tokens += ev.num_draft_tokens
        prog.num_accepted_tokens += ev.num_accepted_tokens
        self.core.num_generated_tokens += len(ev.token_ids)
        finished = ev.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED or len(prog.token_ids) >= r.max_tokens
        prog.finish_reason = ev.finish_reason or (common_pb2.FINISH_REASON_LENGTH if finished else 0)
        if run.cancelled:  # the policy already forgot the step: the sample ends here
            prog.finish_reason, prog.error, finished = ABORT, run.abort_error, True
        else:
            self.core.policy.on_chunk_done(r, worker.worker_id, len(ev.token_ids), finished, now)
        if finished:
            await self.core.delivery.finish(run, [prog])
        self.core.wake()

    async def _on_failed(self, worker: WorkerHandle, a: Assignment, dispatch_id: str, error: str) -> None:
        """The engine failed on this chunk alone: back to the pool (a chunk of 0 tokens)
        until ``max_attempts``; then the sample is given up."""
        entry = self._current(a.request.key, dispatch_id)
        if entry is None:
            return
        run, prog = entry
        self._release(worker, run, prog, time.monotonic())
        if not await self._charge(worker, run, prog, error):
            self.core.policy.on_chunk_done(a.request, worker.worker_id, 0, False, time.monotonic())
        self.core.wake()

    async def _on_run_ended(self, worker: WorkerHandle, pending: dict[str, Assignment], ev: RunEnded) -> None:
        if ev.outcome is RunOutcome.DONE:
            return
        log.warning("worker %s failed a Run call: %s", worker.worker_id, ev.error)
        error = f"worker {worker.worker_id}: {ev.error}"
        for dispatch_id, a in list(pending.items()):
            entry = self._current(a.request.key, dispatch_id)
            if entry is None or ev.outcome not in (RunOutcome.REJECTED, RunOutcome.ENGINE_FAILED):
                continue
            run, prog = entry
            if ev.outcome is RunOutcome.ENGINE_FAILED and prog.num_failures + 1 < self.core.limits.max_attempts:
                prog.num_failures += 1  # counted; re-queued below with the others
                continue
            pending.pop(dispatch_id)  # rejected input (no retry can help), or out of attempts
            self._release(worker, run, prog, time.monotonic())
            prog.num_failures += 1
            await self.core.delivery.give_up(run, prog, worker.worker_id, error)
        if ev.outcome in (RunOutcome.LOST, RunOutcome.WRONG_VERSION):
            self.core.workers.mark_unhealthy(worker.worker_id)  # gone, draining or on another version

    async def _charge(self, worker: WorkerHandle, run: StepRun, prog: SampleProgress, error: str) -> bool:
        """Counts a failed attempt of a released sample; True when it was given up."""
        prog.num_failures += 1
        log.warning("sample %s failed on worker %s (%d/%d): %s", prog.request.key, worker.worker_id,
                    prog.num_failures, self.core.limits.max_attempts, error)
        if prog.num_failures < self.core.limits.max_attempts:
            return False
        await self.core.delivery.give_up(run, prog, worker.worker_id, error)
        return True

    def _requeue(self, worker: WorkerHandle, pending: dict[str, Assignment]) -> None:
        """Chunks their worker will not report run again elsewhere (same seed, same tokens)."""
        now, lost = time.monotonic(), []
        for dispatch_id, a in pending.items():
            entry = self._current(a.request.key, dispatch_id)
            if entry is None:
                continue
            run, prog = entry
            self._release(worker, run, prog, now)
            if run.cancelled:
                self.core.delivery.abort_queued(run, [prog])
            else:
                lost.append(a.request)
        pending.clear()
        if lost:
            log.info("re-queueing %d requests from worker %s", len(lost), worker.worker_id)
            self.core.policy.on_worker_lost(worker.worker_id, lost, now)
        self.core.wake()
