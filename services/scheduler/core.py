"""The scheduler core: steps in flight, the queue (the policy), placement calls, retries,
lifecycle and accounting. Knows no gRPC: workers are reached through a worker link
(``worker_link.py``); tests drive it with in-process fake workers.

A step's path (docs/architecture.md has the whole story):
  1. ``submit``: the intake checks the request once; a step id already held, or logged
     before a restart, is joined (only its missing samples run); a new step is split
     into one request per (prompt, sample) and admitted within the sample limit.
  2. ``_dispatch`` asks the policy for chunks whenever something changed, each step
     capped at its fair share of the slots, and sends each worker its chunks as one
     batch on its Link stream.
  3. Each chunk's tokens extend their sample; an unfinished sample goes back to the
     policy (its next chunk may run on another worker).
  4. A finished sample goes to the step log, then to the trainer (``delivery.py``).
  5. A worker lost mid-chunk: its chunks run elsewhere with the same seeds (the same
     tokens); a chunk that fails the engine is retried, up to ``max_attempts``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass

from rhymerl.v1 import common_pb2, rollout_pb2

from services.common import metrics
from services.common.errors import FailedPrecondition, NotFound, ResourceExhausted, Unavailable
from services.history.breaker import HistoryBreaker
from services.scheduler import intake
from services.scheduler.delivery import Delivery
from services.scheduler.fair_share import step_quotas
from services.scheduler.length_model import LengthModel
from services.scheduler.policies.base import Assignment, Policy, RequestKey
from services.scheduler.run_calls import RunCalls
from services.scheduler.serving import ServingVersion
from services.scheduler.step import SampleProgress, StepRun, fingerprint
from services.scheduler.step_log import StepLog
from services.scheduler.step_table import StepTable
from services.scheduler.timeline import StepTimeline
from services.scheduler.workers import WorkerHandle, WorkerTable

log = logging.getLogger(__name__)
ABORT = common_pb2.FINISH_REASON_ABORT
INTAKE_SLICE = 1024  # samples split between two turns of the event loop (a prompt's samples are never split)


@dataclass(frozen=True)
class CoreLimits:
    max_samples_in_flight: int = 262_144  # admitted, unfinished samples over all steps
    max_attempts: int = 3  # chunks of a sample that may fail before it is given up
    no_worker_timeout_s: float = 30.0  # queued work with no worker this long is aborted
    abandoned_step_timeout_s: float = 300.0  # a step no trainer follows this long is cancelled (0: never)
    history_epochs: int = 4  # epochs of history used for length prediction
    history_timeout_s: float = 2.0  # a step waits at most this long for a history call (docs/architecture.md)
    fair_share: str = "matched"  # fair_share.py: "matched", "equal" or "work_conserving"
    handover_slice: int = 4096  # a step's samples go to the policy this many at a time (docs/architecture.md)


class SchedulerCore:
    def __init__(self, policy: Policy, workers: WorkerTable, link, *, steps: StepTable | None = None,
                 step_log: StepLog | None = None, history=None, limits: CoreLimits = CoreLimits()):
        self.policy, self.workers, self.link, self.history, self.limits = policy, workers, link, history, limits
        self.steps = steps if steps is not None else StepTable()  # an empty one is falsy
        self.log = step_log if step_log is not None else StepLog("")
        self.lengths = LengthModel()
        # the step's history calls: a short deadline, skipped a while after one timed out
        self.history_reads = HistoryBreaker(limits.history_timeout_s, name="scheduler")
        self.serving = ServingVersion()
        self.unfinished: dict[RequestKey, SampleProgress] = {}  # its step is its ``run``
        self._admitting = 0  # samples of steps in intake, not in ``unfinished`` yet
        self.active: dict[str, StepRun] = {}  # steps whose requests the policy holds, arrival order
        self.held: list[StepRun] = []  # steps admitted while a push waits for the running ones
        self.hold_new_steps = False
        self.paused = False  # no new chunks (a push between chunks)
        self.num_generated_tokens = 0
        self.delivery = Delivery(self)
        self.runs = RunCalls(self)
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._no_worker_since: float | None = None

    # --- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        # exported from the start (0, or the version its record restored), not from the first change
        metrics.weight_version.labels(component="scheduler").set(self.policy_version)
        self._loop_task = asyncio.create_task(self._dispatch_loop())

    async def stop(self) -> None:
        tasks = [t for t in [self._loop_task, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def wake(self) -> None:
        self._wake.set()

    @property
    def policy_version(self) -> int:
        return self.serving.version

    def set_version(self, version: int) -> None:
        """A push made ``version`` serving."""
        self.serving.pushed(version)
        metrics.weight_version.labels(component="scheduler").set(version)

    def settle_version(self) -> None:
        """Called periodically (``serving.py`` says why)."""
        if self.serving.settled:  # the usual case: nothing to look at
            return
        nobody_serves = not self.workers.any_serving(self.policy_version)
        if self.serving.settle([w.policy_version for w in self.workers.usable()], nobody_serves, time.monotonic()):
            self._version_changed("the newest registered")

    def register(self, worker_id: str, address: str, capacity: int, version: int, vocab_size: int,
                 max_model_len: int, *, draining: bool = False, polled: bool = False) -> WorkerHandle | None:
        """A worker announced itself (registration is also its heartbeat: O(1) when
        nothing changed). A draining worker's beat keeps it known, never adds it (None)."""
        known = self.workers.workers.get(worker_id)
        if known is None and draining:
            return None
        if known is not None and not known.state.healthy:  # back: likely a new process
            self.link.reset(worker_id)
        # only a newer version can change the serving one (serving.on_register)
        nobody_serves = version > self.policy_version and not self.workers.any_serving(self.policy_version)
        w, changed = self.workers.add(worker_id, address, capacity, version, vocab_size, max_model_len,
                                      draining=draining, polled=polled)
        if self.serving.on_register(version, nobody_serves, time.monotonic()):
            self._version_changed(f"worker {worker_id}")
        if changed:
            self.wake()
        return w

    def _version_changed(self, source: str) -> None:
        metrics.weight_version.labels(component="scheduler").set(self.policy_version)
        log.info("serving version %d (from %s)", self.policy_version, source)

    # --- 1. submit -------------------------------------------------------------------
    async def submit(self, req: rollout_pb2.SubmitStepRequest) -> StepRun:
        """Starts a step, or joins the one with the same step_id (in memory or logged). A
        step that ended with aborted samples (no worker, a cancel, a fault) is run again:
        its finished samples replayed, its aborted ones generated (their own seeds); a
        cancelled one still ending (its workers' aborts on the way) first ends."""
        intake.check_step(req, self.policy_version)
        run = self.steps.get(req.step_id)
        if run is not None and run.fingerprint != fingerprint(req):
            raise FailedPrecondition(f"step {req.step_id!r} was already submitted with different content",
                                     "step_id")
        if run is not None and run.cancelled and not run.is_finished:
            # A cancelled step ends when its workers have reported the aborts of its running
            # samples; joined before that, the resubmission would get those aborts. It is run
            # again once it has ended (the wait ends with the call if the trainer goes).
            await run.finished.wait()
            run = self.steps.get(req.step_id)
        if run is None or (run.is_finished and run.aborted):
            run = await self.steps.open(req.step_id, lambda prior=run: self._open(req, prior))
        if run.fingerprint != fingerprint(req):
            raise FailedPrecondition(f"step {req.step_id!r} was already submitted with different content",
                                     "step_id")
        return run

    async def _open(self, req: rollout_pb2.SubmitStepRequest, prior: StepRun | None = None) -> StepRun:
        """A new step, or one known before: ``prior`` (kept in memory, finished with
        aborted samples) or logged (a previous scheduler's). Only the samples that finished
        (not ABORT) are restored; the others are generated."""
        logged = await self.log.load(req.step_id) if prior is None else None
        if logged is not None and logged.fingerprint != fingerprint(req):
            raise FailedPrecondition(f"step {req.step_id!r} was already submitted with different content",
                                     "step_id")
        known = prior.sample_results() if prior is not None else logged.samples if logged is not None else []
        restored = {(s.prompt_id, s.sample_index): s for s in known if s.finish_reason != ABORT}
        retried = len(known) - len(restored)
        logged_summary = logged.summary if logged is not None and not retried else None
        done = logged_summary is not None
        num_missing = len(req.prompts) * req.n - len(restored)
        in_flight = len(self.unfinished) + self._admitting
        if in_flight + num_missing > self.limits.max_samples_in_flight:  # checked before any sample exists
            raise ResourceExhausted(f"{num_missing} samples would exceed the limit of samples in flight "
                                    f"({in_flight} of {self.limits.max_samples_in_flight} used)", "prompts")
        self._admitting += num_missing  # other steps' intakes run while this one yields
        try:
            samples, since_yield = [], 0
            for group in intake.split(req, intake.Fleet(0, 0) if done else self._fleet()):
                samples += group
                since_yield += len(group)
                if since_yield >= INTAKE_SLICE:  # a huge step's intake takes a while: let other work in
                    since_yield = 0
                    await asyncio.sleep(0)
            run = StepRun(req, samples)
            missing = [s for s in samples if (s.request.prompt_id, s.request.sample_index) not in restored] \
                if restored else samples
            for s in missing:
                self.unfinished[s.request.key] = s
        finally:
            self._admitting -= num_missing
        metrics.samples_in_flight.set(len(self.unfinished))
        self.steps.add(run)
        self.delivery.timelines[run.step_id] = StepTimeline(run.step_id, list(self.workers.workers))
        if logged is None and prior is None:
            await self.log.open(run.step_id, run.fingerprint, sorted(run.prompt_ids), run.n)
        else:
            metrics.steps_total.labels(status="resumed").inc()
            log.info("step %s resumed from its %s: %d of %d samples done, %d aborted ones generated again",
                     run.step_id, "log" if prior is None else "aborted run", len(restored), run.num_samples,
                     retried)
        await self.delivery.restore(run, samples, restored, logged_summary)
        if missing:
            await self._load_lengths(run, missing)
            if self.hold_new_steps:  # a weight push waits for the running steps first
                self.held.append(run)
            elif (handover := self._hand_to_policy(run)) is not None:
                await handover
            metrics.steps_total.labels(status="submitted").inc()
        return run

    def _fleet(self) -> intake.Fleet:
        workers = self.workers.usable()
        if not workers:
            raise Unavailable("no rollout worker is registered and healthy")
        return intake.Fleet(min((w.vocab_size for w in workers if w.vocab_size), default=0),
                            min((w.max_model_len for w in workers if w.max_model_len), default=0))

    async def _load_lengths(self, run: StepRun, missing: list[SampleProgress]) -> None:
        """The prompts' earlier lengths, for the length model (one history round trip,
        waited for at most ``history_timeout_s``; skipped while history hangs)."""
        prompt_ids = sorted({s.request.prompt_id for s in missing})
        lengths: dict[str, list[list[int]]] = {}
        if self.history is not None:
            try:
                found = await self.history_reads.read(
                    lambda: self.history.get_history(prompt_ids, max_epochs=self.limits.history_epochs,
                                                     include_tokens=False), "length lookup")
                lengths = {pid: [list(e.lengths) for e in epochs] for pid, epochs in found.items() if epochs}
            except Exception as exc:  # noqa: BLE001 - history is an optimisation, never a failure
                # (the breaker logs one WARNING per outage)
                log.debug("step %s predicts without history: %s", run.step_id, exc)
        run.history_hit_rate = len(lengths) / len(prompt_ids)
        self.lengths.load_history(lengths)

    def _hand_to_policy(self, run: StepRun) -> asyncio.Task | None:
        """The step becomes active now; its missing samples go to the policy a slice at a
        time, in a task of the core (returned; stop() ends it)."""
        run.in_policy = True
        pending, run.to_hand_over = [s for s in run.to_hand_over if not s.done], []
        if run.cancelled:
            self.delivery.abort_queued(run, pending)
            return None
        self.active[run.step_id] = run
        return self.spawn(self._hand_over(run, pending))

    async def _hand_over(self, run: StepRun, pending: list[SampleProgress]) -> None:
        """A huge step's predictions take a while: health checks and other trainers' calls
        are served between slices, and its first slices may already run. A cancel in
        between takes what the policy holds; the rest is aborted here, never queued."""
        slices = self.policy.add_step_in_slices([s.request for s in pending], self.lengths, time.monotonic(),
                                                self.limits.handover_slice)
        handed = 0
        try:
            while not run.cancelled:
                handed = next(slices, None)
                if handed is None:
                    return
                self.wake()
                await asyncio.sleep(0)
            self.delivery.abort_queued(run, pending[handed:])
        finally:
            slices.close()

    def release_held(self) -> None:
        held, self.held = self.held, []
        for run in held:
            self._hand_to_policy(run)

    # --- 2. placement ----------------------------------------------------------------
    async def _dispatch_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self._dispatch()
            except Exception:  # noqa: BLE001 - the loop must survive a policy bug
                log.exception("scheduling failed")
            await asyncio.sleep(0)

    def _dispatch(self) -> None:
        metrics.queue_depth.set(self.policy.num_queued())
        if self.paused or not self.policy.num_queued():
            return
        workers = self.workers.serving(self.policy_version) if self.serving.dispatchable else []
        if not workers:
            return
        running = {step_id: run.num_running for step_id, run in self.active.items()}
        queued = {step_id: run.num_unfinished - run.num_running for step_id, run in self.active.items()}
        sizes = {step_id: run.num_samples for step_id, run in self.active.items()}
        quotas = step_quotas(sum(w.state.capacity for w in workers), running, queued, self.limits.fair_share, sizes)
        now, states = time.monotonic(), [w.state for w in workers]
        for quota in [None] if quotas is None else [q for _, q in quotas]:
            by_worker: dict[str, list[Assignment]] = defaultdict(list)
            for a in self.policy.schedule(states, now, quota):
                by_worker[a.worker_id].append(a)
            for worker_id, assignments in by_worker.items():  # books the slots before the next step's turn
                self.runs.start(self.workers.workers[worker_id], assignments, now)

    # --- cancel, weights, no workers ---------------------------------------------------
    async def cancel(self, step_id: str) -> int:
        intake.check_id(step_id, "step_id")
        run = self.steps.get(step_id)
        if run is None:
            raise NotFound(f"no step {step_id!r}", "step_id")
        return await self.delivery.cancel(run)

    def cancel_abandoned(self, now: float | None = None) -> list[str]:
        """Called periodically: cancels the steps that no trainer has followed (no SubmitStep
        stream open on them) for ``abandoned_step_timeout_s``, as CancelStep does: a trainer
        that went (Ctrl-C, a crash, a deadline) no longer holds the fleet. One that comes
        back within the timeout rejoins its step; after it, resubmitting the step id runs
        its aborted samples again (its finished ones replayed). Returns their ids."""
        timeout = self.limits.abandoned_step_timeout_s
        if not timeout:
            return []
        now = time.monotonic() if now is None else now
        gone = [run for run in self.steps if not run.is_finished and not run.cancelled and not run.closing
                and run.unfollowed_since is not None and now - run.unfollowed_since >= timeout]
        for run in gone:
            error = f"no trainer followed the step for {now - run.unfollowed_since:.0f} s (abandoned_step_timeout_s)"
            log.warning("step %s: %s: cancelling its %d unfinished samples", run.step_id, error, run.num_unfinished)
            metrics.steps_abandoned_total.inc()
            self.spawn(self.delivery.cancel(run, error))
        return [run.step_id for run in gone]

    def abort_if_no_workers(self) -> None:
        """Called periodically: ends work that no worker could take for too long."""
        if not self.unfinished or self.workers.any_serving(self.policy_version):
            self._no_worker_since = None
            return
        now = time.monotonic()
        self._no_worker_since = self._no_worker_since or now
        if now - self._no_worker_since < self.limits.no_worker_timeout_s:
            return
        error = f"no worker served version {self.policy_version} for {now - self._no_worker_since:.0f} s"
        log.error("%s: aborting %d samples", error, len(self.unfinished))
        for run in {id(s.run): s.run for s in self.unfinished.values()}.values():
            self.spawn(self.delivery.cancel(run, error))

    def worker_lost(self, worker: WorkerHandle) -> None:
        """A worker stopped answering: its chunks run elsewhere."""
        self.workers.mark_unhealthy(worker.worker_id)
        self.runs.worker_lost(worker)

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("scheduler task failed", exc_info=task.exception())
