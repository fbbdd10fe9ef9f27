"""Turns steps into per-sample work, places it with the policy, and collects results.

The request's path (docs/architecture.md has the whole story):
  1. ``submit`` validates a step, splits it into one Request per sample, asks the
     history service for the prompts' earlier lengths (one round trip), and hands
     the requests to the policy.
  2. The scheduling loop asks the policy for assignments whenever something
     changed, and sends each worker one Run call with the items placed on it.
  3. Each ChunkResult is appended to its sample; an unfinished sample goes back
     to the policy (divided rollout: its next chunk may run elsewhere).
  4. A finished sample is published to the step's log at once; when the last one
     finishes, the rollouts are written to history and the summary closes the log.
  5. A worker whose stream breaks is marked unhealthy and its unfinished chunks
     are re-queued: the seed fixes each sample, so a re-run gives the same tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict

import grpc
from rhymerl.v1 import common_pb2, rollout_pb2, worker_pb2

from services.common import metrics
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from services.common.ids import prompt_id_from_tokens, request_id, sample_seed
from services.common.validation import MAX_N, check_sampling, check_token_ids
from services.scheduler.length_model import LengthModel
from services.scheduler.policies.base import Assignment, Policy, Request
from services.scheduler.step import SampleProgress, StepRun
from services.scheduler.timeline import StepTimeline
from services.scheduler.workers import WorkerHandle, WorkerTable

log = logging.getLogger(__name__)
FINISH_NAMES = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                common_pb2.FINISH_REASON_ABORT: "abort"}


class Dispatcher:
    """Owns the steps in flight and the loop that feeds the workers.

    Args:
        policy: the placement policy (services/scheduler/policies).
        workers: the worker table.
        history: a HistoryClient, or None to run without history.
    """

    def __init__(self, policy: Policy, workers: WorkerTable, history, *, history_epochs: int = 4,
                 max_steps_retained: int = 64, max_queued_samples: int = 1_000_000,
                 no_worker_timeout_s: float = 30.0, max_attempts: int = 3):
        self.policy = policy
        self.workers = workers
        self.history = history
        self.history_epochs = history_epochs
        self.max_steps_retained = max_steps_retained
        self.max_queued_samples = max_queued_samples
        self.no_worker_timeout_s = no_worker_timeout_s
        self.max_attempts = max(1, max_attempts)
        self.lengths = LengthModel()
        self.policy_version = 0
        self.steps: OrderedDict[str, StepRun] = OrderedDict()
        self.timelines: dict[str, StepTimeline] = {}
        self.unfinished: dict[str, tuple[StepRun, SampleProgress]] = {}
        self.num_generated_tokens = 0
        self.spec = common_pb2.SpecCounters()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._paused = False
        self._tasks: set[asyncio.Task] = set()
        self._loop_task: asyncio.Task | None = None
        self._no_worker_since: float | None = None

    # --- lifecycle -------------------------------------------------------------
    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._schedule_loop())

    async def stop(self) -> None:
        for task in [self._loop_task, *self._tasks]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*[t for t in [self._loop_task, *self._tasks] if t], return_exceptions=True)

    def wake(self) -> None:
        self._wake.set()

    # --- 1. submit -------------------------------------------------------------
    async def submit(self, req: rollout_pb2.SubmitStepRequest) -> StepRun:
        """Starts a step, or returns the existing one with the same step_id."""
        existing = self.steps.get(req.step_id)
        if existing is not None:
            if existing.fingerprint != StepRun.fingerprint_of(req):
                raise FailedPrecondition(f"step {req.step_id!r} was already submitted with different content",
                                         "step_id")
            return existing
        samples = self._validate_and_split(req)
        run = StepRun(req, samples)
        self.steps[req.step_id] = run
        self._evict_finished_steps()
        for s in samples:
            self.unfinished[s.request.request_id] = (run, s)
        self._idle.clear()
        await self._load_lengths(run)
        self.timelines[run.step_id] = StepTimeline(run.step_id, list(self.workers.workers))
        self.policy.add_step([s.request for s in samples], self.lengths, time.monotonic())
        metrics.steps_total.labels(status="submitted").inc()
        self._export_queue()
        self.wake()
        return run

    def _validate_and_split(self, req: rollout_pb2.SubmitStepRequest) -> list[SampleProgress]:
        if not req.step_id:
            raise InvalidArgument("must be non-empty", "step_id")
        if not req.prompts:
            raise InvalidArgument("must be non-empty", "prompts")
        if not 1 <= req.n <= MAX_N:
            raise InvalidArgument(f"must be in [1, {MAX_N}], got {req.n}", "n")
        if req.policy_version > self.policy_version:
            raise FailedPrecondition(
                f"version {req.policy_version} is not serving yet (serving {self.policy_version}); push it first",
                "policy_version")
        workers = self.workers.usable()
        if not workers:
            raise Unavailable("no rollout worker is registered and healthy")
        vocab = min((w.vocab_size for w in workers if w.vocab_size), default=0)
        max_len = min((w.max_model_len for w in workers if w.max_model_len), default=0)
        check_sampling(req.sampling, "sampling", vocab)
        num_samples = len(req.prompts) * req.n
        queued = len(self.unfinished)
        if queued + num_samples > self.max_queued_samples:
            raise ResourceExhausted(
                f"{num_samples} samples would exceed the queue limit ({queued} of {self.max_queued_samples} used)",
                "prompts")
        samples, seen = [], set()
        step_seed = req.sampling.seed if req.sampling.HasField("seed") else None
        for i, prompt in enumerate(req.prompts):
            field = f"prompts[{i}]"
            check_token_ids(prompt.token_ids, f"{field}.token_ids", vocab)
            if max_len and len(prompt.token_ids) >= max_len:
                raise InvalidArgument(
                    f"prompt length {len(prompt.token_ids)} leaves no room to generate within the model's "
                    f"maximum length {max_len}", f"{field}.token_ids")
            if max_len and len(prompt.token_ids) + req.sampling.max_tokens > max_len:
                raise InvalidArgument(
                    f"prompt length {len(prompt.token_ids)} + max_tokens {req.sampling.max_tokens} exceeds the "
                    f"model's maximum length {max_len}", "sampling.max_tokens")
            pid = prompt.prompt_id or prompt_id_from_tokens(prompt.token_ids)
            if pid in seen:
                raise InvalidArgument(f"duplicate prompt_id {pid!r}", f"{field}.prompt_id")
            seen.add(pid)
            tokens = list(prompt.token_ids)
            for k in range(req.n):
                r = Request(request_id=request_id(req.step_id, pid, k), step_id=req.step_id, prompt_id=pid,
                            sample_index=k, prompt_len=len(tokens), max_tokens=req.sampling.max_tokens)
                seed = sample_seed(step_seed, req.step_id, pid, k)
                samples.append(SampleProgress(r, tokens, seed))
        return samples

    async def _load_lengths(self, run: StepRun) -> None:
        """Loads the step's prompts' earlier lengths into the length model (one round trip)."""
        prompt_ids = sorted({s.request.prompt_id for s in run.samples.values()})
        lengths: dict[str, list[list[int]]] = {}
        if self.history is not None:
            try:
                found = await self.history.get_history(prompt_ids, max_epochs=self.history_epochs,
                                                       include_tokens=False)
                lengths = {pid: [list(e.lengths) for e in epochs] for pid, epochs in found.items() if epochs}
            except Exception as exc:  # noqa: BLE001 - history is an optimisation, never a failure
                log.warning("history lookup failed for step %s: %s", run.step_id, exc)
        run.history_hit_rate = len(lengths) / len(prompt_ids)
        self.lengths.load_history(lengths)

    def _evict_finished_steps(self) -> None:
        while len(self.steps) > self.max_steps_retained:
            oldest_id, oldest = next(iter(self.steps.items()))
            if not oldest.is_finished:
                break
            del self.steps[oldest_id]

    # --- 2. placement ----------------------------------------------------------
    async def _schedule_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self._schedule_once()
            except Exception:  # noqa: BLE001 - the loop must survive a policy bug
                log.exception("scheduling failed")

    def _schedule_once(self) -> None:
        if self._paused:
            return
        workers = [w for w in self.workers.usable() if w.policy_version == self.policy_version]
        if not workers:
            return
        now = time.monotonic()
        by_worker: dict[str, list[Assignment]] = defaultdict(list)
        for a in self.policy.schedule([w.state for w in workers], now):
            by_worker[a.worker_id].append(a)
        for worker_id, assignments in by_worker.items():
            worker = self.workers.workers[worker_id]
            for a in assignments:
                self._mark_running(worker, a, now)
            self._spawn(self._run_on(worker, assignments))
        self._export_queue()

    def _mark_running(self, worker: WorkerHandle, a: Assignment, now: float) -> None:
        r = a.request
        timeline = self.timelines[r.step_id]
        if a.is_migration:
            timeline.on_migration()
            metrics.migrations_total.inc()
        if not worker.state.running:
            self._set_busy(worker.worker_id, True, now)
        worker.state.running[r.request_id] = r
        timeline.on_dispatch(worker.worker_id, now)

    def _set_busy(self, worker_id: str, busy: bool, now: float) -> None:
        for step_id, timeline in self.timelines.items():
            if not self.steps[step_id].is_finished:
                timeline.on_worker_busy(worker_id, busy, now)

    # --- 3. results ------------------------------------------------------------
    async def _run_on(self, worker: WorkerHandle, assignments: list[Assignment]) -> None:
        pending = {a.request.request_id: a for a in assignments}
        items = [self._work_item(a) for a in assignments]
        try:
            stream = worker.stub.Run(worker_pb2.RunRequest(items=items, policy_version=self.policy_version))
            async for result in stream:
                a = pending.pop(result.request_id, None)
                if a is None:
                    continue
                if result.error:
                    await self._on_item_failed(worker, a, f"worker {worker.worker_id}: {result.error}")
                else:
                    await self._on_chunk(worker, a, result)
        except grpc.RpcError as err:
            code = err.code()
            log.warning("worker %s failed a Run call: %s %s", worker.worker_id, code, err.details())
            error = f"worker {worker.worker_id}: {code.name}: {err.details()}"
            # INTERNAL/UNKNOWN: the engine failed on these requests; the worker lives on.
            # Retried elsewhere, up to max_attempts (a poison request must not loop).
            failed = code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
            for a in list(pending.values()):
                if self._progress(a.request) is None:
                    continue  # already finished: released below
                if code == grpc.StatusCode.INVALID_ARGUMENT:  # no retry can help
                    pending.pop(a.request.request_id)
                    await self._abort_running(worker, a.request, error)
                elif await self._charge_failure(worker, a, error, counts=failed):
                    pending.pop(a.request.request_id)
            if code not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.INTERNAL):
                self.workers.mark_unhealthy(worker.worker_id)  # gone, draining or on another version
        finally:
            if pending:
                self._requeue(worker, [a.request for a in pending.values()])

    def _work_item(self, a: Assignment) -> worker_pb2.WorkItem:
        run, prog = self.unfinished[a.request.request_id]
        r = a.request
        return worker_pb2.WorkItem(
            request_id=r.request_id, prompt_id=r.prompt_id, sample_index=r.sample_index,
            prompt_token_ids=prog.prompt_token_ids, generated_token_ids=prog.token_ids,
            sampling=self._sample_params(run, prog), max_new_tokens=a.max_new_tokens, step_id=r.step_id,
            num_samples=sum(1 for s in run.samples.values() if s.request.prompt_id == r.prompt_id))

    @staticmethod
    def _sample_params(run: StepRun, prog: SampleProgress) -> common_pb2.SamplingParams:
        params = common_pb2.SamplingParams()
        params.CopyFrom(run.sampling)
        params.seed = prog.seed
        return params

    async def _on_chunk(self, worker: WorkerHandle, a: Assignment, result: worker_pb2.ChunkResult) -> None:
        run, prog = self.unfinished[a.request.request_id]
        r = a.request
        now = time.monotonic()
        self._release(worker, r, now)
        prog.token_ids.extend(result.token_ids)
        prog.logprobs.extend(result.logprobs)
        prog.token_versions.extend([result.policy_version] * len(result.token_ids))
        prog.num_verify_steps += result.spec.num_verify_steps
        prog.num_draft_tokens += result.spec.num_draft_tokens
        prog.num_accepted_tokens += result.spec.num_accepted_tokens
        finished = (result.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                    or len(prog.token_ids) >= r.max_tokens)
        prog.finish_reason = result.finish_reason or (common_pb2.FINISH_REASON_LENGTH if finished else 0)
        if run.cancelled:
            # The policy already forgot the step: the sample ends here, as aborted.
            prog.finish_reason, finished = common_pb2.FINISH_REASON_ABORT, True
        else:
            self.policy.on_chunk_done(r, worker.worker_id, len(result.token_ids), finished, now)
        if finished:
            await self._finish_sample(run, prog, now)
        self.wake()

    async def _on_item_failed(self, worker: WorkerHandle, a: Assignment, error: str) -> None:
        """The engine failed on this request alone: retry it (another chunk of 0 tokens,
        back to the pool) until max_attempts, then give it up."""
        now = time.monotonic()
        if self._progress(a.request) is None:  # already finished (a repeated result)
            self._release(worker, a.request, now)
            return
        if await self._charge_failure(worker, a, error):
            return
        self._release(worker, a.request, now)
        self.policy.on_chunk_done(a.request, worker.worker_id, 0, False, now)
        self.wake()

    async def _charge_failure(self, worker: WorkerHandle, a: Assignment, error: str, counts: bool = True) -> bool:
        """Counts a failed attempt of an unfinished sample (when ``counts``); after
        max_attempts it is given up. Returns whether it was given up."""
        prog = self._progress(a.request)
        prog.num_failures += counts
        if counts:
            log.warning("sample %s failed on worker %s (%d/%d): %s", a.request.request_id, worker.worker_id,
                        prog.num_failures, self.max_attempts, error)
        if prog.num_failures < self.max_attempts:
            return False
        await self._abort_running(worker, a.request, error)
        return True

    def _release(self, worker: WorkerHandle, r: Request, now: float) -> None:
        worker.state.running.pop(r.request_id, None)
        if not worker.state.running:
            self._set_busy(worker.worker_id, False, now)

    def _requeue(self, worker: WorkerHandle, requests: list[Request]) -> None:
        now = time.monotonic()
        for r in requests:
            self._release(worker, r, now)
        live = [r for r in requests if r.request_id in self.unfinished]
        for r in [r for r in live if self.steps[r.step_id].cancelled]:
            live.remove(r)
            run, prog = self.unfinished[r.request_id]
            prog.finish_reason = common_pb2.FINISH_REASON_ABORT
            self._spawn(self._finish_sample(run, prog, now))
        if live:
            log.info("re-queueing %d requests from worker %s", len(live), worker.worker_id)
            self.policy.on_worker_lost(worker.worker_id, live, now)
        self.wake()

    def _progress(self, r: Request) -> SampleProgress | None:
        entry = self.unfinished.get(r.request_id)
        return entry[1] if entry is not None else None

    async def _abort_running(self, worker: WorkerHandle, r: Request, error: str) -> None:
        run, prog = self.unfinished[r.request_id]
        now = time.monotonic()
        self._release(worker, r, now)
        prog.finish_reason = common_pb2.FINISH_REASON_ABORT
        prog.error = error
        log.error("giving up sample %s after %d failed attempts: %s", r.request_id, prog.num_failures, error)
        metrics.samples_failed_total.inc()
        r.aborted = True
        self.policy.on_chunk_done(r, worker.worker_id, 0, True, now)
        await self._finish_sample(run, prog, now)

    # --- 4. completion ---------------------------------------------------------
    async def _finish_sample(self, run: StepRun, prog: SampleProgress, now: float) -> None:
        if prog.done:
            return
        prog.done = True
        del self.unfinished[prog.request.request_id]
        run.num_done += 1
        self.timelines[run.step_id].on_sample_done(now)
        self.num_generated_tokens += len(prog.token_ids)
        metrics.samples_total.labels(finish_reason=FINISH_NAMES.get(prog.finish_reason, "abort")).inc()
        await run.publish(rollout_pb2.StepEvent(sample=run.sample_result(prog, self.policy_version)))
        if run.num_done == len(run.samples):
            await self._finish_step(run, now)

    async def _finish_step(self, run: StepRun, now: float) -> None:
        await self._record_history(run)
        stats = self.timelines.pop(run.step_id).finish(now)
        samples = run.samples.values()
        spec = common_pb2.SpecCounters(
            num_verify_steps=sum(s.num_verify_steps for s in samples),
            num_draft_tokens=sum(s.num_draft_tokens for s in samples),
            num_accepted_tokens=sum(s.num_accepted_tokens for s in samples))
        for name in ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens"):
            setattr(self.spec, name, getattr(self.spec, name) + getattr(spec, name))
        summary = rollout_pb2.StepSummary(
            step_id=run.step_id, num_samples=len(run.samples),
            num_generated_tokens=sum(len(s.token_ids) for s in samples),
            makespan_s=stats.makespan_s, bubble_ratio=stats.bubble_ratio, tail_time_s=stats.tail_time_s,
            spec=spec, num_migrations=stats.num_migrations, worker_busy_s=stats.worker_busy_s,
            history_hit_rate=run.history_hit_rate, policy=self.policy.name)
        metrics.step_makespan_seconds.set(stats.makespan_s)
        metrics.step_makespan_hist.observe(stats.makespan_s)
        metrics.step_bubble_ratio.set(stats.bubble_ratio)
        metrics.step_tail_seconds.set(stats.tail_time_s)
        metrics.step_spec_draft_tokens.set(spec.num_draft_tokens)
        metrics.step_spec_accepted_tokens.set(spec.num_accepted_tokens)
        metrics.steps_total.labels(status="finished").inc()
        await run.publish(rollout_pb2.StepEvent(summary=summary), last=True)
        if not self.unfinished:
            self._idle.set()
        self._export_queue()

    async def _record_history(self, run: StepRun) -> None:
        if self.history is None:
            return
        rows = [(s.request.prompt_id, run.step_id, s.request.sample_index, min(s.token_versions, default=0),
                 s.token_ids) for s in run.samples.values()
                if s.finish_reason != common_pb2.FINISH_REASON_ABORT]
        try:
            await self.history.put_rollouts(rows)
        except Exception as exc:  # noqa: BLE001 - the trainer still gets its samples
            log.warning("could not record step %s in history: %s", run.step_id, exc)

    # --- cancel, weights, health -----------------------------------------------
    async def cancel(self, step_id: str) -> int:
        if not step_id:
            raise InvalidArgument("must be non-empty", "step_id")
        run = self.steps.get(step_id)
        if run is None:
            raise NotFound(f"no step {step_id!r}", "step_id")
        now = time.monotonic()
        run.cancelled = True
        queued = self.policy.cancel_step(step_id)
        for r in queued:
            _, prog = self.unfinished[r.request_id]
            prog.finish_reason = common_pb2.FINISH_REASON_ABORT
            await self._finish_sample(run, prog, now)
        running: dict[str, list[str]] = defaultdict(list)
        for w in self.workers.workers.values():
            for rid, r in w.state.running.items():
                if r.step_id == step_id:
                    running[w.worker_id].append(rid)
        for worker_id, ids in running.items():
            try:
                await self.workers.workers[worker_id].stub.Abort(worker_pb2.AbortRequest(request_ids=ids), timeout=10)
            except grpc.RpcError as err:
                log.warning("abort on %s failed: %s", worker_id, err.code())
        metrics.steps_total.labels(status="cancelled").inc()
        return len(queued) + sum(len(v) for v in running.values())

    async def exclusive(self):
        """Pauses dispatch and waits until no sample is in flight (for weight updates)."""
        self._paused = True
        await self._idle.wait()

    def resume(self, policy_version: int | None = None) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
            metrics.weight_version.labels(component="scheduler").set(policy_version)
        self._paused = False
        self.wake()

    def abort_if_no_workers(self) -> None:
        """Called periodically: fails work that no worker could take for too long."""
        if not self.unfinished or self.workers.usable():
            self._no_worker_since = None
            return
        now = time.monotonic()
        self._no_worker_since = self._no_worker_since or now
        if now - self._no_worker_since < self.no_worker_timeout_s:
            return
        log.error("no worker for %.0f s: aborting %d samples", now - self._no_worker_since, len(self.unfinished))
        for run, prog in list(self.unfinished.values()):
            for r in self.policy.cancel_step(run.step_id):
                _, p = self.unfinished[r.request_id]
                p.finish_reason = common_pb2.FINISH_REASON_ABORT
                self._spawn(self._finish_sample(run, p, now))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("dispatcher task failed", exc_info=task.exception())

    def _export_queue(self) -> None:
        metrics.queue_depth.set(self.policy.num_queued())
