"""The chunks in flight on the workers' Link streams: chunks sent to a worker in
batches, their results applied to the samples a batch at a time, their failures retried
or given up.

Each worker has one long-lived stream (``worker_link.LinkStream``), opened when it is
first given work; a dispatch pass sends a worker one batch. Every chunk gets a dispatch
id of its own. A sample's ``dispatch_id`` names its chunk in flight; a result for any
other id is stale (its worker was declared lost and the chunk re-ran elsewhere) and is
ignored, so a sample never takes a chunk's tokens twice. A stream that ends (a broken
worker, its loss) re-queues the chunks it had not reported, exactly those.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from typing import TYPE_CHECKING

from rhymerl.v1 import common_pb2

from services.common import metrics
from services.scheduler.policies.base import Assignment, Request, RequestKey
from services.scheduler.step import SampleProgress, StepRun
from services.scheduler.worker_link import Chunk, ChunkDone, ChunkFailed, RunEnded, RunOutcome
from services.scheduler.workers import WorkerHandle

if TYPE_CHECKING:
    from services.scheduler.core import SchedulerCore

log = logging.getLogger(__name__)
ABORT = common_pb2.FINISH_REASON_ABORT
UNSPECIFIED = common_pb2.FINISH_REASON_UNSPECIFIED
LENGTH = common_pb2.FINISH_REASON_LENGTH


class _Stream:
    """One worker's open stream and the chunks it has not reported (dispatch id ->
    assignment)."""

    __slots__ = ("worker", "address", "link", "pending", "task")

    def __init__(self, worker: WorkerHandle, link):
        self.worker, self.address, self.link = worker, worker.address, link
        self.pending: dict[str, Request] = {}
        self.task: asyncio.Task | None = None


class RunCalls:
    def __init__(self, core: SchedulerCore):
        self.core = core
        self.num_chunks = 0  # in flight, all workers
        self._no_chunks = asyncio.Event()
        self._no_chunks.set()
        self._dispatch_ids = itertools.count()
        self._incarnation = secrets.token_hex(4)  # dispatch ids never repeat across restarts
        self._prefix = self._incarnation + "-"  # every dispatch id's, before its number
        self._streams: dict[str, _Stream] = {}  # worker_id -> its open stream

    async def drained(self) -> None:
        """Returns when no chunk is in flight."""
        await self._no_chunks.wait()

    def start(self, worker: WorkerHandle, assignments: list[Assignment], now: float) -> None:
        """Sends ``assignments`` to ``worker`` as one batch on its stream."""
        stream = self._stream(worker)
        core, worker_id, running, pending = self.core, worker.worker_id, worker.state.running, stream.pending
        unfinished, timelines, prefix, counter = core.unfinished, core.delivery.timelines, self._prefix, self._dispatch_ids
        if assignments and not running:
            core.delivery.set_busy(worker_id, True, now)
        chunks, last_run = [], None
        for a in assignments:
            request = a.request
            key = request.key
            prog = unfinished[key]
            run = prog.run
            prog.dispatch_id = dispatch_id = prefix + str(next(counter))
            run.num_running += 1
            running[key] = pending[dispatch_id] = request
            if run is not last_run:  # the batch's chunks share ``now``: once per step is enough
                timelines[run.step_id].on_dispatch(worker_id, now)
                last_run = run
            if a.is_migration:
                timelines[run.step_id].on_migration()
                metrics.migrations_total.inc()
            chunks.append(Chunk(dispatch_id, key, prog.prompt_field, prog.token_ids, prog.num_tokens, run.sampling,
                                prog.seed_varint, a.max_new_tokens, run.step_fields))
        if chunks:
            self.num_chunks += len(chunks)
            self._no_chunks.clear()
        stream.link.send(core.policy_version, chunks)

    def abort(self, worker_id: str, dispatch_ids: list[str]) -> None:
        """Asks the worker to abort these chunks (on its stream: a worker with none open
        runs none); their results come back as ABORT."""
        stream = self._streams.get(worker_id)
        if stream is not None:
            stream.link.abort(dispatch_ids)

    def worker_lost(self, worker: WorkerHandle) -> None:
        """Ends ``worker``'s stream; its chunks are re-queued."""
        stream = self._streams.pop(worker.worker_id, None)
        if stream is not None:
            stream.task.cancel()

    def _stream(self, worker: WorkerHandle) -> _Stream:
        stream = self._streams.get(worker.worker_id)
        if stream is not None and stream.address == worker.address:
            return stream
        if stream is not None:  # it moved (a new process elsewhere): the old stream's chunks run again
            stream.task.cancel()
        stream = self._streams[worker.worker_id] = _Stream(worker, self.core.link.open(worker))
        stream.task = self.core.spawn(self._read(stream))
        stream.task.add_done_callback(lambda _, s=stream: self._closed(s))
        return stream

    def _closed(self, stream: _Stream) -> None:
        """The stream's reader ended (the stream broke, or was cancelled: also before its
        first step): what it had not reported runs again elsewhere."""
        if self._streams.get(stream.worker.worker_id) is stream:
            del self._streams[stream.worker.worker_id]
        stream.link.close()
        self._requeue(stream.worker, stream.pending)

    async def _read(self, stream: _Stream) -> None:
        async for batch in stream.link.events():
            if isinstance(batch, RunEnded):
                if self._streams.get(stream.worker.worker_id) is stream:  # new work opens a new stream
                    del self._streams[stream.worker.worker_id]
                await self._on_run_ended(stream.worker, stream.pending, batch)
                return
            await self._on_batch(stream, batch)

    async def _on_batch(self, stream: _Stream, events: list) -> None:
        """A batch of results: applied, then each step's finished samples delivered together."""
        worker, pending, now = stream.worker, stream.pending, time.monotonic()
        finished: dict[str, tuple[StepRun, list[SampleProgress]]] = {}
        for ev in events:
            r = pending.pop(ev.dispatch_id, None)
            if r is None:
                continue
            if type(ev) is ChunkDone:
                done = self._on_chunk(worker, r, ev, now)
                if done is not None:
                    step = finished.get(done.run.step_id)
                    if step is None:
                        step = finished[done.run.step_id] = (done.run, [])
                    step[1].append(done)
            else:
                await self._on_failed(worker, r, ev)
        # applied: the chunks' payloads are the samples' now. Emptied before the delivery's
        # wait (every stream's batch may wait at once), so the events go now, not after it.
        events.clear()
        for run, progs in finished.values():
            await self.core.delivery.finish(run, progs)
        self.core.wake()

    def _current(self, key: RequestKey, dispatch_id: str) -> tuple[StepRun, SampleProgress] | None:
        """The sample, if ``dispatch_id`` is its chunk in flight (else the result is stale)."""
        prog = self.core.unfinished.get(key)
        return (prog.run, prog) if prog is not None and prog.dispatch_id == dispatch_id else None

    def _release(self, worker: WorkerHandle, run: StepRun, prog: SampleProgress, now: float) -> None:
        worker.state.running.pop(prog.request.key, None)
        prog.dispatch_id = None
        run.num_running -= 1
        self.num_chunks -= 1
        if not self.num_chunks:
            self._no_chunks.set()
        if not worker.state.running:
            self.core.delivery.set_busy(worker.worker_id, False, now)

    def _on_chunk(self, worker: WorkerHandle, r: Request, ev: ChunkDone, now: float) -> SampleProgress | None:
        """Extends the sample by the chunk's payloads (as bytes); returns it when finished."""
        prog = self.core.unfinished.get(r.key)  # ``_current``, inlined: once per chunk
        if prog is None or prog.dispatch_id != ev.dispatch_id:
            return None
        run, num = prog.run, ev.num_tokens
        self._release(worker, run, prog, now)
        if num:
            prog.token_ids += ev.token_ids
            prog.logprobs += ev.logprobs
            version = ev.policy_version
            if prog.version < 0:
                prog.version = version
            elif prog.versions is not None or version != prog.version:  # spans versions: runs kept
                runs = prog.versions
                if runs is None:
                    runs = prog.versions = [[prog.version, prog.num_tokens]]
                if runs[-1][0] == version:
                    runs[-1][1] += num
                else:
                    runs.append([version, num])
            prog.num_tokens += num
        if ev.num_draft_tokens or ev.num_verify_steps or ev.num_accepted_tokens:  # a drafter's counters
            prog.num_verify_steps += ev.num_verify_steps
            prog.num_draft_tokens += ev.num_draft_tokens
            prog.num_accepted_tokens += ev.num_accepted_tokens
        self.core.num_generated_tokens += num
        finished = ev.finish_reason != UNSPECIFIED or prog.num_tokens >= r.max_tokens
        prog.finish_reason = ev.finish_reason or (LENGTH if finished else 0)
        if run.cancelled:  # the policy already forgot the step: the sample ends here
            prog.finish_reason, prog.error, finished = ABORT, run.abort_error, True
        else:
            self.core.policy.on_chunk_done(r, worker.worker_id, num, finished, now)
        return prog if finished else None

    async def _on_failed(self, worker: WorkerHandle, r: Request, ev: ChunkFailed) -> None:
        """The worker gave no tokens for this chunk: the engine failed on it (back to the
        pool, a chunk of 0 tokens, until ``max_attempts``; then the sample is given up),
        it refused the input (given up: no retry can help), or it drains or serves another
        version (marked unhealthy; the chunk runs elsewhere, not charged)."""
        entry = self._current(r.key, ev.dispatch_id)
        if entry is None:
            return
        error = f"worker {worker.worker_id}: {ev.error}"
        if ev.outcome in (RunOutcome.LOST, RunOutcome.WRONG_VERSION):
            log.warning("worker %s refused a chunk: %s", worker.worker_id, ev.error)
            self.core.workers.mark_unhealthy(worker.worker_id)
            self._requeue(worker, {ev.dispatch_id: r})
            return
        run, prog = entry
        self._release(worker, run, prog, time.monotonic())
        if ev.outcome is RunOutcome.REJECTED:
            prog.num_failures += 1
            await self.core.delivery.give_up(run, prog, worker.worker_id, error)
        elif not await self._charge(worker, run, prog, error):
            self.core.policy.on_chunk_done(r, worker.worker_id, 0, False, time.monotonic())
        self.core.wake()

    async def _on_run_ended(self, worker: WorkerHandle, pending: dict[str, Request], ev: RunEnded) -> None:
        if ev.outcome is RunOutcome.DONE:  # the worker ended it: what it had not reported runs elsewhere
            return
        if ev.outcome in (RunOutcome.LOST, RunOutcome.WRONG_VERSION):
            self.core.workers.mark_unhealthy(worker.worker_id)  # gone, draining or on another version
        log.warning("worker %s's stream failed: %s", worker.worker_id, ev.error)
        error = f"worker {worker.worker_id}: {ev.error}"
        for dispatch_id, r in list(pending.items()):
            entry = self._current(r.key, dispatch_id)
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

    async def _charge(self, worker: WorkerHandle, run: StepRun, prog: SampleProgress, error: str) -> bool:
        """Counts a failed attempt of a released sample; True when it was given up."""
        prog.num_failures += 1
        log.warning("sample %s failed on worker %s (%d/%d): %s", prog.request.key, worker.worker_id,
                    prog.num_failures, self.core.limits.max_attempts, error)
        if prog.num_failures < self.core.limits.max_attempts:
            return False
        await self.core.delivery.give_up(run, prog, worker.worker_id, error)
        return True

    def _requeue(self, worker: WorkerHandle, pending: dict[str, Request]) -> None:
        """Chunks their worker will not report run again elsewhere (same seed, same tokens)."""
        now, lost = time.monotonic(), []
        for dispatch_id, r in pending.items():
            entry = self._current(r.key, dispatch_id)
            if entry is None:
                continue
            run, prog = entry
            self._release(worker, run, prog, now)
            if run.cancelled:
                self.core.delivery.abort_queued(run, [prog])
            else:
                lost.append(r)
        pending.clear()
        if lost:
            log.info("re-queueing %d requests from worker %s", len(lost), worker.worker_id)
            self.core.policy.on_worker_lost(worker.worker_id, lost, now)
        self.core.wake()
