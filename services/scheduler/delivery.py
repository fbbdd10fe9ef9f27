"""Delivery: how samples and steps end. A finished sample goes to the step log, then to
the trainer's stream; the sample that completes the step closes it (history, summary).
Also: samples restored from the step log after a restart, samples given up, steps
cancelled, and the per-step timelines (busy workers, makespan, bubbles).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import TYPE_CHECKING

from rhymerl.v1 import common_pb2, rollout_pb2

from services.common import metrics, packed
from services.scheduler import summary
from services.scheduler.step import SampleProgress, StepRun
from services.scheduler.timeline import StepTimeline

if TYPE_CHECKING:
    from services.scheduler.core import SchedulerCore

log = logging.getLogger(__name__)
ABORT = common_pb2.FINISH_REASON_ABORT
CANCEL_BATCH = 2048
MAX_PENDING_WRITES = 8  # history writes still running after their steps closed (history slow or hung)


class Delivery:
    def __init__(self, core: SchedulerCore):
        self.core = core
        self.timelines: dict[str, StepTimeline] = {}  # steps not closed yet
        self.spec_totals = common_pb2.SpecCounters()  # all steps closed by this scheduler
        self.history_writes: set[asyncio.Task] = set()  # running; each holds its step's rows
        self.num_history_writes_dropped = 0  # steps not written: MAX_PENDING_WRITES were still running

    def set_busy(self, worker_id: str, busy: bool, now: float) -> None:
        for timeline in self.timelines.values():
            timeline.on_worker_busy(worker_id, busy, now)

    async def restore(self, run: StepRun, samples: list[SampleProgress],
                      logged: dict[tuple[str, int], rollout_pb2.SampleResult],
                      logged_summary: rollout_pb2.StepSummary | None) -> None:
        """Publishes the samples a previous scheduler logged; they are not generated again."""
        if not logged:  # a new step: nothing to look up per sample
            return
        events, reasons = [], []
        for s in samples:
            result = logged.get((s.request.prompt_id, s.request.sample_index))
            if result is not None:
                s.done = True
                run.num_done += 1
                if result.finish_reason == ABORT:
                    run.aborted.add((result.prompt_id, result.sample_index))
                run.num_generated_tokens += len(result.token_ids)
                for i, name in enumerate(summary.SPEC_FIELDS):
                    run.spec[i] += getattr(result.spec, name)
                events.append(rollout_pb2.StepEvent(sample=result).SerializeToString())
                reasons.append(result.finish_reason)
        if events:
            await self._publish(run, events, reasons, logged_summary)

    async def finish(self, run: StepRun, progs: list[SampleProgress]) -> None:
        """Ends samples whose ``finish_reason`` is set: logged, then streamed. Each goes
        as the bytes ``StepRun.encode_event`` splices (its tokens never decoded)."""
        now, logged, events, reasons = time.monotonic(), [], [], []
        timeline = self.timelines.get(run.step_id)
        version = self.core.policy_version
        log_on = self.core.log.enabled  # else no copy is kept for it (every stream's batch may wait here at once)
        for prog in progs:
            if prog.done:
                continue
            prog.done = True
            self.core.unfinished.pop(prog.request.key, None)
            run.num_done += 1
            if timeline is not None:
                timeline.on_sample_done(now)
            key = (prog.request.prompt_id, prog.request.sample_index)
            if prog.finish_reason == ABORT:
                run.aborted.add(key)
            run.num_generated_tokens += prog.num_tokens
            spec = run.spec
            spec[0] += prog.num_verify_steps
            spec[1] += prog.num_draft_tokens
            spec[2] += prog.num_accepted_tokens
            event = run.encode_event(prog, version)
            prog.token_ids = prog.logprobs = b""  # in the event now: the step keeps only that
            if log_on:  # the SampleResult: the event without its key and length
                logged.append((key, packed.payload(event)))
            events.append(event)
            reasons.append(prog.finish_reason)
        metrics.samples_in_flight.set(len(self.core.unfinished))
        if events:  # shielded: a cancelled caller (a lost worker's stream) must not lose them
            await asyncio.shield(self._deliver(run, logged, events, reasons))

    async def _deliver(self, run: StepRun, logged: list[tuple[tuple[str, int], bytes]], events: list[bytes],
                       reasons: list[int]) -> None:
        await self.core.log.append(run.step_id, logged)
        await self._publish(run, events, reasons)

    async def _publish(self, run: StepRun, events: list[bytes], reasons: list[int],
                       logged_summary: rollout_pb2.StepSummary | None = None) -> None:
        summary.count_samples(reasons)
        await run.publish(events)
        run.num_published += len(events)
        if run.num_published == run.num_samples and not run.closing:
            run.closing = True
            await self._close(run, logged_summary)

    async def _close(self, run: StepRun, logged_summary: rollout_pb2.StepSummary | None) -> None:
        core = self.core
        core.active.pop(run.step_id, None)
        timeline = self.timelines.pop(run.step_id, None) or StepTimeline(run.step_id, [])
        step_summary = logged_summary or summary.step_summary(run, timeline.finish(time.monotonic()),
                                                              core.policy.name)
        if logged_summary is None:
            await self._record_history(run)
            await core.log.close(run.step_id, step_summary)
        summary.export(step_summary, self.spec_totals)
        await run.publish([rollout_pb2.StepEvent(summary=step_summary)], last=True)
        core.steps.evict()

    async def _record_history(self, run: StepRun) -> None:
        """Writes the step's rollouts to history before its summary goes out, so the next
        epoch finds them; but the summary waits for the write at most the history deadline
        (``CoreLimits.history_timeout_s``), and not at all while the breaker is open
        (history timed out lately): the write then goes on behind the summary, with the
        client's own deadline. At most ``MAX_PENDING_WRITES`` run behind closed steps; a
        step closing beyond them is not written (history is an optimisation)."""
        core = self.core
        if core.history is None:
            return
        if len(self.history_writes) >= MAX_PENDING_WRITES:
            self.num_history_writes_dropped += 1
            log.debug("step %s not written to history: %d writes still wait for it", run.step_id,
                      len(self.history_writes))
            return
        breaker = core.history_reads
        write = core.spawn(summary.record_history(core.history, run.step_id, summary.history_rows(run), breaker))
        self.history_writes.add(write)
        write.add_done_callback(self.history_writes.discard)
        if not breaker.is_open:
            await asyncio.wait({write}, timeout=breaker.timeout_s)  # (the write is never cancelled here)

    def abort_queued(self, run: StepRun, progs: list[SampleProgress]) -> None:
        """Ends samples that run nowhere as ABORT (their step was cancelled)."""
        for prog in progs:
            prog.finish_reason, prog.error = ABORT, run.abort_error
        self.core.spawn(self.finish(run, progs))

    async def give_up(self, run: StepRun, prog: SampleProgress, worker_id: str, error: str) -> None:
        """After ``max_attempts`` failures (or input a worker refuses): ABORT, with why."""
        prog.finish_reason, prog.error = ABORT, error
        log.error("giving up sample %s after %d failed attempts: %s", prog.request.key, prog.num_failures, error)
        metrics.samples_failed_total.inc()
        prog.request.aborted = True
        self.core.policy.on_chunk_done(prog.request, worker_id, 0, True, time.monotonic())
        await self.finish(run, [prog])

    async def cancel(self, run: StepRun, error: str = "") -> int:
        """Ends every unfinished sample of ``run`` as ABORT; returns how many. Queued ones
        end at once; running ones when their worker reports the abort (or is lost)."""
        core = self.core
        if run.is_finished or run.closing or run.cancelled:
            return 0
        run.cancelled, run.abort_error = True, error
        core.active.pop(run.step_id, None)
        if run.in_policy:
            queued = [core.unfinished[r.key] for r in core.policy.cancel_step(run.step_id)
                      if r.key in core.unfinished]
        else:  # held for a weight push, or not handed over yet: nothing runs
            core.held = [r for r in core.held if r is not run]
            queued = [s for s in run.to_hand_over if not s.done]
        running: dict[str, list[str]] = defaultdict(list)
        for s in [s for s in core.unfinished.values() if s.run is run]:  # no index per step: a scan, once
            if not s.done and s.dispatch_id is not None:
                running[s.request.last_worker].append(s.dispatch_id)
        for prog in queued:
            prog.finish_reason, prog.error = ABORT, error
        for i in range(0, len(queued), CANCEL_BATCH):  # a huge step: let other work in between
            await self.finish(run, queued[i:i + CANCEL_BATCH])
            await asyncio.sleep(0)
        for worker_id, dispatch_ids in running.items():
            core.runs.abort(worker_id, dispatch_ids)
        metrics.steps_total.labels(status="cancelled").inc()
        return len(queued) + sum(map(len, running.values()))
