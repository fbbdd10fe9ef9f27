"""The rollout worker process: WorkerService over an engine running in its own thread.

Thin transport: Link (the scheduler's one stream) turns work items into checked engine
requests (work_item.py), has the prompts' history loaded into the drafter
(drafter_history.py), hands the items to the engine loop and streams the chunks' results
back in batches, their tokens and logprobs packed (services/common/packed.py); weight
updates are verified, then applied while idle.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from functools import partial

from rhymerl.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from services.common import metrics, packed
from services.common.errors import InvalidArgument, SettingError, grpc_errors
from services.common.gc_tuning import StepCollector, tune_gc
from services.common.grpc_server import Server, run_until_signal
from services.history.breaker import HistoryBreaker
from services.rollout import weight_receiver
from services.rollout.drafter_history import MAX_HISTORY_TOKENS, DrafterHistory
from services.rollout.engine_choice import build_engine
from services.rollout.engine_loop import AbortedChunk, EngineLoop, ItemFailed
from services.rollout.global_feed import GlobalFeed
from services.rollout.registration import deregister, keep_registered
from services.rollout.settings import WorkerSettings
from services.rollout.work_item import to_engine_request

log = logging.getLogger(__name__)
FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
          "abort": common_pb2.FINISH_REASON_ABORT, None: common_pb2.FINISH_REASON_UNSPECIFIED}
_END = object()  # the scheduler closed its side of a Link stream
_CLOSE = object()  # this worker ends its Link streams (its drain is over): what they hold runs elsewhere


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, loop: EngineLoop, worker_id: str, model_name: str, version: int, history=None,
                 history_epochs: int = 4, max_num_seqs: int = 256, feed: GlobalFeed | None = None,
                 history_breaker=None, history_tokens: int = MAX_HISTORY_TOKENS):
        self.loop = loop
        self.engine = loop.engine
        self.config = loop.engine.model.config
        self.worker_id = worker_id
        self.model_name = model_name
        self.version = version
        self.sha256 = ""  # of the pushed bytes serving ("" when loaded from a path)
        self._initial = True  # still on the checkpoint it started from
        # (a new prompt's earlier epochs load behind the next forward: its requests wait for them)
        load = partial(loop.call_deferred, urgent=True)
        # (the history reads a batch waits for share one breaker: the feed's unless given)
        breaker = history_breaker if history_breaker is not None else getattr(feed, "breaker", None)
        self.drafter_history = DrafterHistory(self.engine.drafter, history, load, history_epochs,
                                              breaker=breaker, max_tokens=history_tokens) if (
            history is not None and self.engine.drafter is not None) else None
        self.max_num_seqs = max_num_seqs
        self.feed = feed  # the drafter's global index: finished samples + the history stream
        self.accepting = True
        self.num_items = 0  # in the engine from Link streams (a drain waits for them)
        self._links: set[asyncio.Queue] = set()  # the open Link streams' sinks (close_links)
        self.num_generated_tokens = 0
        self.spec = common_pb2.SpecCounters()
        self._weights_lock = asyncio.Lock()
        self.max_push_bytes = weight_receiver.max_push_bytes(self.engine.model)
        metrics.weight_version.labels(component=worker_id).set(version)
        # (once: the engine and its cache do not change; every work item is checked against it)
        self.max_model_len = served_length(self.engine, self.config)
        if self.max_model_len < self.config.max_position_embeddings:
            log.warning("the engine holds sequences of at most %d tokens (its KV cache or its own limit), below the "
                        "model's %d: steps whose prompt + max_tokens exceed it are refused",
                        self.max_model_len, self.config.max_position_embeddings)

    # --- Link --------------------------------------------------------------------
    @grpc_errors
    async def Link(self, request_iterator, context):
        """The scheduler's stream: batches of items and aborts in, batches of results out
        (every result ready when the stream writes goes in one message). An item is
        checked alone: one that is not valid input, or that this worker will not run
        (draining, another version), comes back at once with its refusal. A stream that
        breaks aborts what it holds."""
        sink: asyncio.Queue = asyncio.Queue()
        pending: dict[str, object] = {}  # request_id -> EngineRequest, in the engine
        reader = asyncio.create_task(self._take(request_iterator, sink, pending))
        self._links.add(sink)
        try:
            closing = ended = False
            while not (closing and not pending) and not ended:
                outs = [await sink.get()]
                while not sink.empty():
                    outs.append(sink.get_nowait())
                results = []
                for out in outs:
                    if out is _END:
                        closing = True
                    elif out is _CLOSE:
                        ended = True
                    elif isinstance(out, BaseException):
                        raise out  # the reader's own failure, or the engine's beyond one item
                    elif isinstance(out, worker_pb2.ChunkResult):  # a refusal
                        results.append(out)
                    else:
                        results.append(self._result(out, pending))
                if results:
                    yield worker_pb2.LinkResponse(results=results)
        finally:
            self._links.discard(sink)
            reader.cancel()
            for rid in pending:
                self.loop.abort(rid)
            self.num_items -= len(pending)
            pending.clear()

    def close_links(self) -> None:
        """Ends every open Link stream with OK once the results ready are written: the
        scheduler runs what a stream held elsewhere (as when the scheduler closes it), and
        the server's stop has no handler left to cancel (gRPC logged each one it cancelled
        as an ERROR with a traceback)."""
        for sink in self._links:
            sink.put_nowait(_CLOSE)

    async def _take(self, request_iterator, sink: asyncio.Queue, pending: dict) -> None:
        """Reads the scheduler's batches into the engine; _END when it closed its side."""
        try:
            async for batch in request_iterator:
                for rid in batch.abort_request_ids:
                    self.loop.abort(rid)
                if batch.items:
                    await self._start(batch, sink, pending)
            sink.put_nowait(_END)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - ends the stream with it (grpc_errors words it)
            sink.put_nowait(exc)

    async def _start(self, batch: worker_pb2.LinkRequest, sink: asyncio.Queue, pending: dict) -> None:
        refusal, why = worker_pb2.REFUSAL_NONE, ""
        if not self.accepting:
            refusal, why = worker_pb2.REFUSAL_DRAINING, "worker is draining"
        elif batch.policy_version and batch.policy_version != self.version:
            refusal = worker_pb2.REFUSAL_WRONG_VERSION
            why = f"policy_version: this worker serves version {self.version}, not {batch.policy_version}"
        accepted = []
        for i, item in enumerate(batch.items):
            if refusal:
                sink.put_nowait(self._refusal(item.request_id, refusal, why))
                continue
            try:
                accepted.append((item, to_engine_request(item, f"items[{i}]", self.config.vocab_size,
                                                         self.max_model_len)))
            except InvalidArgument as exc:
                sink.put_nowait(self._refusal(item.request_id, worker_pb2.REFUSAL_INVALID_ARGUMENT, str(exc)))
        if not accepted:
            return
        items = [item for item, _ in accepted]
        if self.drafter_history is not None:
            await self.drafter_history.load(items)
        if self.feed is not None:
            await self.feed.step_started({it.step_id for it in items})
        for _, r in accepted:
            pending[r.request_id] = r
            self.num_items += 1
            self.loop.submit(r, sink)

    def _refusal(self, request_id: str, refusal: int, error: str) -> worker_pb2.ChunkResult:
        return worker_pb2.ChunkResult(request_id=request_id, refusal=refusal, error=error,
                                      policy_version=self.version)

    def _result(self, out, pending: dict) -> worker_pb2.ChunkResult:
        """An engine output (a chunk, an abort, an item's failure) as its ChunkResult."""
        r = pending.pop(out.request_id, None)
        if r is not None:
            self.num_items -= 1
        if isinstance(out, ItemFailed):
            if isinstance(out.error, ValueError):  # the engine refused the input
                return self._refusal(out.request_id, worker_pb2.REFUSAL_INVALID_ARGUMENT, str(out.error))
            return worker_pb2.ChunkResult(request_id=out.request_id, policy_version=self.version,
                                          error=f"{type(out.error).__name__}: {out.error}")
        if isinstance(out, AbortedChunk):
            return worker_pb2.ChunkResult(request_id=out.request_id, finish_reason=common_pb2.FINISH_REASON_ABORT,
                                          policy_version=self.version)
        if r is not None and self.feed is not None and out.finish_reason in ("stop", "length"):
            self.feed.finished(r.prompt_id, r.step_id, r.sample_index, [*r.generated_token_ids, *out.token_ids])
        spec = common_pb2.SpecCounters(num_verify_steps=out.num_verify_steps, num_draft_tokens=out.num_draft_tokens,
                                       num_accepted_tokens=out.num_accepted_tokens)
        self.num_generated_tokens += len(out.token_ids)
        for name in ("num_verify_steps", "num_draft_tokens", "num_accepted_tokens"):
            setattr(self.spec, name, getattr(self.spec, name) + getattr(spec, name))
        return worker_pb2.ChunkResult(
            request_id=out.request_id, packed_token_ids=packed.pack_token_ids(out.token_ids),
            num_tokens=len(out.token_ids), packed_logprobs=packed.pack_logprobs(out.logprobs),
            finish_reason=FINISH[out.finish_reason], policy_version=self.version, spec=spec, busy_s=out.busy_s)

    # --- control -----------------------------------------------------------------
    @grpc_errors
    async def Abort(self, request, context):
        for rid in request.request_ids:
            self.loop.abort(rid)
        return worker_pb2.AbortResponse(num_aborted=len(request.request_ids))

    @grpc_errors
    async def PushWeights(self, request_iterator, context):
        receiving = metrics.weight_pushes_in_progress.labels(component=self.worker_id)
        receiving.inc()
        try:
            async with self._weights_lock:
                payload = await weight_receiver.receive(request_iterator, self.max_push_bytes)
                current = self.sha256
                if not current and self._initial and payload.version == self.version:  # a re-push of the start?
                    current = self.sha256 = await asyncio.to_thread(weight_receiver.checkpoint_sha256,
                                                                    self.model_name)
                if weight_receiver.check_version(payload.version, self.version, payload.sha256, current):
                    await self._apply(payload.version, lambda: self._read(payload.data), payload.sha256)
                return common_pb2.WeightUpdateResponse(version=self.version, num_workers_updated=1)
        finally:
            receiving.dec()

    @grpc_errors
    async def LoadWeights(self, request, context):
        async with self._weights_lock:
            files = weight_receiver.safetensors_files(request.path)  # first: the scheduler probes paths so
            weight_receiver.check_version(request.version, self.version)

            def read_all():
                state = {}
                for f in files:
                    state.update(self._read(str(f)))
                return state

            await self._apply(request.version, read_all, "")
            return common_pb2.WeightUpdateResponse(version=self.version, num_workers_updated=1)

    @staticmethod
    def _read(source):
        from services.rollout.loader import read_safetensors

        try:
            return read_safetensors(source)
        except Exception as exc:  # noqa: BLE001 - a corrupt payload is the caller's input
            raise InvalidArgument(f"not a readable safetensors payload: {exc}", "data") from exc

    async def _apply(self, version: int, read, sha256: str) -> None:
        """Reads and checks the new weights (in a thread), then loads them in the engine
        thread once it is idle, setting the version (and the pushed bytes' SHA-256, "" for
        a path) with them. The weights and the version change together or not at all: a
        call cancelled (the scheduler gave up on it, the trainer's deadline) before the
        engine began the load leaves both as they were; one cancelled after waits for the
        load to end, so the version always says what the engine serves."""
        started = time.monotonic()
        state = await asyncio.to_thread(lambda: weight_receiver.check_finite(read()))
        claim = threading.Lock()
        fate: list[str] = []  # "begun" (by the engine thread) or "abandoned" (by the call), whichever came first

        def load() -> None:
            with claim:
                if fate:
                    return
                fate.append("begun")
            try:
                self.engine.load_weights(state)
            except ValueError as exc:
                raise InvalidArgument(str(exc), "data") from exc
            self.version, self.sha256, self._initial = version, sha256, False

        task = asyncio.ensure_future(self.loop.call_when_idle(load))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            with claim:
                fate.append("abandoned")
            if fate[0] == "begun":
                await _outlive_cancellation(task)
                if self.version == version:
                    self._applied(version, started, "although its call was cancelled during the load")
            raise
        self._applied(version, started)

    def _applied(self, version: int, started: float, note: str = "") -> None:
        metrics.weight_version.labels(component=self.worker_id).set(version)
        metrics.weight_update_seconds.labels(component=self.worker_id).observe(time.monotonic() - started)
        log.info("now serving version %d%s", version, f" ({note})" if note else "")

    @grpc_errors
    async def GetWorkerStats(self, request, context):
        e = self.engine
        return worker_pb2.WorkerStats(
            worker_id=self.worker_id, policy_version=self.version, num_running=e.num_running(),
            num_waiting=e.num_waiting(), num_generated_tokens=self.num_generated_tokens, spec=self.spec,
            kv_cache_free=1.0 - e.kv_cache_usage(), model=self.model_name, vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
            accepting=self.accepting)




def served_length(engine, config) -> int:
    """The longest sequence (prompt + max_tokens) a worker serves, as it registers it: the
    model's maximum length, the engine's own, and the tokens its KV cache holds (a longer
    sample was admitted, generated until its chunk outgrew the cache, then aborted)."""
    limits = [config.max_position_embeddings, getattr(engine, "max_model_len", 0) or 0]
    bm = getattr(engine, "block_manager", None)
    if bm is not None:
        limits.append(bm.num_blocks * bm.block_size)
    return min(x for x in limits if x > 0)


async def _outlive_cancellation(task: asyncio.Future) -> None:
    """Waits for ``task`` to end even if this coroutine is cancelled again meanwhile."""
    while not task.done():
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            continue
    if not task.cancelled():
        task.exception()  # retrieved: the caller re-raises its own cancellation


async def start_worker(settings: WorkerSettings, engine=None):
    """Starts a worker in this event loop; returns (server, port, stop coroutine fn)."""
    if not settings.model_path and engine is None:
        raise SettingError("model_path", "a checkpoint directory is required")
    worker_id = settings.worker_id(settings.port)
    engine = engine or await asyncio.to_thread(build_engine, settings, worker_id)
    history = None
    if settings.history_address:
        from services.history.client import HistoryClient

        history = HistoryClient(settings.history_address, tls=settings.tls())
    # the reads a batch waits for (earlier epochs, recent responses): bounded, skipped while history hangs
    breaker = HistoryBreaker(settings.history_timeout_s, name=f"worker {worker_id}")
    loop = EngineLoop(engine, worker_id, asyncio.get_running_loop(), settings.feed_tokens_per_step)
    loop.start()
    feed = None
    if hasattr(engine.drafter, "add_global_responses"):
        feed = GlobalFeed(loop, engine.drafter, history, settings.global_recent_responses,
                          settings.global_recent_tokens, chunk_tokens=max(1, settings.feed_tokens_per_step // 2),
                          worker_id=worker_id, breaker=breaker)
    servicer = WorkerServicer(loop, worker_id, settings.model_path, settings.initial_version, history,
                              settings.history_epochs, settings.max_num_seqs, feed, history_breaker=breaker,
                              history_tokens=settings.history_tokens)
    server = Server([(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer)],
                    ["rhymerl.v1.WorkerService"], tls=settings.tls(), health_port=settings.health_port)
    port = await server.start(settings.host, settings.port)
    if not settings.id:
        servicer.worker_id = settings.worker_id(port)
    registration = None
    if settings.scheduler_address:
        registration = asyncio.create_task(keep_registered(settings, servicer, settings.address(port)))
    log.info("worker %s listening on port %d", servicer.worker_id, port)

    async def stop() -> None:
        """Drains: stop taking work, leave the scheduler, finish what runs, then exit."""
        servicer.accepting = False  # its beats say it drains from now on
        await server.set_serving(False)
        if registration is not None:
            await deregister(settings.scheduler_address, servicer.worker_id, settings.tls(), settings.scheduler_token)
        deadline = time.monotonic() + settings.drain_timeout_s
        while servicer.num_items and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        servicer.close_links()  # what is still running is given back (the scheduler re-queues it)
        if registration is not None:
            registration.cancel()
        await server.stop(grace=1.0)
        loop.stop()
        if history is not None:
            await history.close()

    server.servicer, server.registration = servicer, registration
    return server, port, stop


def worker_collector(settings: WorkerSettings) -> StepCollector | None:
    """The garbage collector of a worker with these settings (RHYMERL_WORKER_GC_THRESHOLDS),
    installed in this process: start-up objects frozen, automatic collections deferred;
    None, CPython's collector left as it is, where the setting is empty. (The benchmarks
    that run the engine's or the drafter's steps set their process up with it too.)"""
    thresholds = settings.gc_threshold_values()
    if thresholds is None:
        return None
    collector = StepCollector(thresholds)
    collector.install()
    return collector


def tune_worker_gc(settings: WorkerSettings, engine, worker_id: str = "") -> StepCollector | None:
    """The worker's garbage collector, set once it runs: rhymerl's engine collects behind
    each step's forward (``worker_collector``, returned; every pause exported as
    rhymerl:gc_pause_seconds, by where it ran), vLLM's at the thresholds, automatically."""
    if not hasattr(engine, "collector"):  # vLLM's engine: its step is not ours to split
        tune_gc(settings.gc_threshold_values())
        return None
    collector = worker_collector(settings)
    if collector is not None:
        collector.watch_pauses(lambda seconds, where: metrics.gc_pause_seconds.labels(worker_id, where).observe(seconds))
        engine.collector = collector
        log.info("garbage collector: collections behind each step's forward at thresholds %s",
                 (collector.young, collector.middle, collector.old))
    return collector


async def serve(settings: WorkerSettings) -> None:
    metrics.serve_metrics(settings.metrics_port)
    server, _, stop = await start_worker(settings)
    tune_worker_gc(settings, server.servicer.loop.engine, server.servicer.worker_id)
    await run_until_signal(stop)
