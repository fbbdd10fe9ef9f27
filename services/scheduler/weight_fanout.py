"""Fans a weight update out to every worker, keeping the fleet on one version.

A push is streamed through: each chunk from the trainer is forwarded to every worker
as it arrives (the scheduler never holds the whole model). Workers check size,
SHA-256 and finiteness themselves and switch only when the payload is complete.
What can be refused before the payload's end is refused here, before it reaches a
worker: the header (with the workers' own check, before any stream to one opens) and
bytes past its ``total_bytes``. A worker's refusal in the middle of the stream races
with the chunks still being forwarded to it: gRPC could then end its call as
"INTERNAL: Internal error from Core" instead, and the trainer got UNAVAILABLE (which
the SDK retries) for a push that can never succeed.

When a push applies, by ``mode``:
  - ``after_steps`` (synchronous RL): it waits for the steps running when it arrived
    to finish, while their chunks keep dispatching; steps submitted meanwhile wait for
    the push and then sample the new version.
  - ``between_chunks`` (bounded staleness): it waits only for the chunks in flight;
    unfinished samples continue on the new version, and their per-token versions say so.
Either way, a push that fails or is cancelled (the trainer's deadline) leaves dispatch
running and the old version serving. Re-pushing the version that serves, with the same
bytes, is acknowledged (the SDK retries pushes) and catches up workers that lag.

A worker that comes back on an older version (restarted after the push) is caught up
by the fleet itself: with the path of a loaded version, or with the pushed bytes that
streamed through into the scheduler's weight store (``weight_store.py``: a file, never
memory), streamed to it as a push.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator

import grpc
from rhymerl.v1 import common_pb2

from services.common import metrics
from services.common.errors import (DataLoss, DeadlineExceeded, FailedPrecondition, InvalidArgument, RhymerlError,
                                    Unavailable)
from services.rollout import weight_receiver
from services.rollout.weight_receiver import MAX_WEIGHT_BYTES
from services.scheduler.core import SchedulerCore
from services.scheduler.step_log import RecordUnreadable
from services.scheduler.weight_store import Incoming, WeightStore
from services.scheduler.workers import WorkerHandle

log = logging.getLogger(__name__)
MODES = ("after_steps", "between_chunks")
STALL_S = 300.0  # the scheduler's weight_push_stall_s default
_END = object()
_HEX = frozenset("0123456789abcdefABCDEF")
# A worker's answer about the payload itself (its size, checksum, values, version):
# the trainer gets it as it is. Any other failure (a worker gone, its connection closed,
# a call the scheduler gave up on) is the fleet's, not the payload's: UNAVAILABLE.
_VERDICTS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DATA_LOSS,
                       grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})


class WeightFanout:
    def __init__(self, core: SchedulerCore, mode: str = "after_steps", store: WeightStore | None = None,
                 stall_s: float = STALL_S):
        if mode not in MODES:
            raise ValueError(f"weight update mode must be one of {MODES}, got {mode!r}")
        self.core, self.mode, self.stall_s = core, mode, stall_s
        self.store = store if store is not None else WeightStore()
        # Where a version came from: its SHA-256 when pushed (re-push check; its bytes are
        # in the store), its path when loaded (catch-up). Only for ``source[0]``: a version
        # the scheduler learned from its workers after a restart has no known source.
        self.source: tuple[int, str, str] = (-1, "", "")  # (version, sha256, path)
        self._lock = asyncio.Lock()
        self._catching_up: set[str] = set()  # worker ids
        self._unrecorded = False  # the serving version is not in Redis yet
        self._record_unread = False  # Redis did not answer at start: the record is still to be read

    async def push(self, chunks: AsyncIterator[common_pb2.WeightChunk]) -> common_pb2.WeightUpdateResponse:
        in_progress = metrics.weight_pushes_in_progress.labels(component="scheduler")
        in_progress.inc()
        try:
            async with contextlib.aclosing(_paced(chunks, self.stall_s)) as paced:
                return await self._push(paced)
        finally:
            in_progress.dec()

    async def _push(self, chunks: AsyncIterator[common_pb2.WeightChunk]) -> common_pb2.WeightUpdateResponse:
        first = await anext(chunks, None)
        await check_header(first)  # before the lock, the window, or any worker's stream
        header = first.header
        sha256 = header.sha256.lower()
        async with self._lock:
            re_push = self._check(header.version, sha256=sha256)
            incoming = None if self.store.path(sha256) else self.store.writer(header)
            try:
                async with self._window(re_push):
                    workers = self._targets(header.version, every=self.source[0] != header.version)
                    if not workers:  # every worker serves it already: read the payload, check it, ack
                        await _drain(header, chunks, incoming)
                        self._keep(header.version, incoming)
                        return self._ack()
                    feeds = [_Feed(w, self.core.link.stub(w).PushWeights, first, self.stall_s) for w in workers]
                    try:
                        size = 0
                        async for chunk in chunks:
                            if chunk.HasField("header"):
                                raise InvalidArgument("only the first message may be a header", "header")
                            size += len(chunk.data)
                            if size > header.total_bytes:  # refused here: the workers never see these bytes
                                raise InvalidArgument(f"more than total_bytes ({header.total_bytes}) received", "data")
                            if incoming is not None:
                                await incoming.write(chunk.data)
                            await asyncio.gather(*(f.put(chunk) for f in feeds))
                            if all(f.ended for f in feeds):  # no worker takes it any more: say so now
                                raise _no_worker_took(header.version, feeds)
                        await asyncio.gather(*(f.put(_END) for f in feeds))
                        response = await self._finish(header.version, feeds, sha256=sha256)
                    finally:  # a push that ends short ends the workers' streams: each keeps its version
                        await _end_all(feeds)
                    self._keep(header.version, incoming)
                    return response
            finally:
                if incoming is not None:
                    incoming.discard()  # nothing left once kept

    def _keep(self, version: int, incoming: Incoming | None) -> None:
        """Keeps the pushed bytes of the serving version for workers that come back."""
        if incoming is None or self.source[:2] != (version, incoming.sha256):
            return
        if incoming.commit():
            self.store.keep_only(incoming.sha256)

    async def load(self, request: common_pb2.LoadWeightsRequest) -> common_pb2.WeightUpdateResponse:
        if not request.path:
            raise InvalidArgument("must be non-empty", "path")
        async with self._lock:
            re_load = self._check(request.version, path=request.path)
            if not re_load:
                await self._probe_path(request.path)
            async with self._window(re_load):
                workers = self._targets(request.version)
                if not workers:
                    return self._ack()
                calls = [_WorkerCall(w, self.core.link.stub(w).LoadWeights(request)) for w in workers]
                try:
                    return await self._finish(request.version, calls, path=request.path)
                finally:
                    await _end_all(calls)

    async def _probe_path(self, path: str) -> None:
        """Fails at once for a path a worker cannot read, before waiting for the running
        steps: a worker asked to load its own version checks the path first, then
        refuses the version (FAILED_PRECONDITION: the path is readable; nothing loaded)."""
        worker = self.core.workers.usable()[0]
        probe = common_pb2.LoadWeightsRequest(version=worker.policy_version, path=path)
        try:
            await self.core.link.stub(worker).LoadWeights(probe, timeout=30)
        except grpc.aio.AioRpcError as err:
            if err.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise _as_error(err) from None
            # anything else (readable path, a worker going away) is for the load itself to meet

    async def catch_up(self, worker: WorkerHandle) -> None:
        """Brings a worker that lags (e.g. restarted) to the serving version: it loads the
        path that version came from, or gets its pushed bytes streamed from the store.
        Nothing to do for a version with no known source (learned from the workers).
        Not under the push lock: a push waiting for steps may need this worker to end them."""
        version = self.core.policy_version
        source_version, sha256, path = self.source
        if source_version != version or worker.policy_version >= version or worker.worker_id in self._catching_up:
            return
        if not path and self.store.path(sha256) is None:
            return
        self._catching_up.add(worker.worker_id)
        try:
            stub = self.core.link.stub(worker)
            if path:
                response = await stub.LoadWeights(common_pb2.LoadWeightsRequest(version=version, path=path),
                                                  timeout=600)
            else:
                response = await stub.PushWeights(self.store.stream(version, sha256), timeout=600)
            self.core.workers.set_version(worker, response.version)
            log.info("worker %s caught up to version %d (%s)", worker.worker_id, version,
                     "path" if path else "pushed bytes from the store")
        except (grpc.RpcError, OSError) as err:
            log.warning("worker %s could not catch up to version %d: %s", worker.worker_id, version,
                        err.code() if isinstance(err, grpc.RpcError) else err)
        finally:
            self._catching_up.discard(worker.worker_id)
        self.core.wake()

    def _check(self, version: int, sha256: str = "", path: str = "") -> bool:
        """True for a re-send of the serving version (same bytes or path); raises for an
        older version, or the serving one with other content."""
        serving = self.core.policy_version
        source_version, source_sha256, source_path = self.source
        same = source_version == version and bool((sha256 and sha256 == source_sha256)
                                                    or (path and path == source_path))
        # The serving version's bytes unknown here (the workers' initial weights, or a
        # version learned from them): the workers tell whether a push re-sends them.
        workers_know = bool(sha256) and source_version != serving
        if version < serving or (version == serving and not same and not workers_know):
            raise FailedPrecondition(f"must be greater than the version serving ({serving}), got {version}",
                                     "version")
        if not self.core.workers.usable():
            raise Unavailable("no rollout worker is registered and healthy")
        return version == serving

    def _targets(self, version: int, every: bool = False) -> list[WorkerHandle]:
        """The usable workers not on ``version`` yet (chosen once the push may apply), or
        ``every`` one (a re-push of a version whose bytes only the workers can check)."""
        workers = self.core.workers.usable()
        if not workers:
            raise Unavailable("no rollout worker is registered and healthy")
        return [w for w in workers if every or w.policy_version != version]

    @contextlib.asynccontextmanager
    async def _window(self, re_push: bool):
        """The moment the push applies (see the module docstring); always released. A
        re-push only updates workers that get no work (they lag): it needs no window."""
        core = self.core
        if re_push:
            yield
            return
        try:
            if self.mode == "after_steps":
                core.hold_new_steps = True
                await asyncio.gather(*(run.finished.wait() for run in list(core.active.values())))
            core.paused = True
            await core.runs.drained()
            yield
        finally:
            core.paused = False
            core.hold_new_steps = False
            core.release_held()
            core.wake()

    async def _finish(self, version: int, calls: list["_WorkerCall"], *, sha256: str = "",
                      path: str = "") -> common_pb2.WeightUpdateResponse:
        """Waits for the workers' answers (at most ``stall_s`` once the last chunk was
        queued or the load asked: a worker that checks and loads longer is left out); the
        version serves once a worker took it. The others keep theirs and get no work
        until caught up."""
        pending = {c.task for c in calls if not c.task.done()}
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.stall_s)
            for c in calls:
                if c.task in late:
                    c.give_up(f"did not answer within {self.stall_s:g} s of the last chunk")
            await asyncio.gather(*(c.task for c in calls), return_exceptions=True)
        took = [c for c in calls if c.response is not None]
        for c in took:
            self.core.workers.set_version(c.worker, c.response.version)
        if not took:
            raise _no_worker_took(version, calls)
        for c in calls:
            if c.response is None:
                log.error("worker %s did not take version %d (%s); it gets no work until updated",
                          c.worker.worker_id, version, c.failure())
        if version != self.core.policy_version or self.source[0] != version:
            self.source = (version, sha256, path)
            self.core.set_version(version)
            self._unrecorded = True
            await self.record()
        return self._ack()

    async def record(self) -> None:
        """Records the serving version for a restarted scheduler; the watchdog calls it
        again while Redis could not take it (a stale record would make it serve an old one)."""
        if self._unrecorded and self.source[0] == self.core.policy_version:
            self._unrecorded = not await self.core.log.save_serving(*self.source)

    async def restore(self) -> None:
        """A restarted scheduler takes up the serving version its predecessor recorded."""
        try:
            record = await self.core.log.load_serving()
        except RecordUnreadable as exc:
            log.warning("%s; dispatching once the fleet's version settles", exc)
            self.core.serving.unreadable = self._record_unread = True
            return
        if record is not None:
            self.source = record
            self.core.serving.restore(record[0], catchable=self.store.path(record[1]) is not None)
            log.info("serving version %d (recorded)", record[0])

    async def reread_record(self) -> None:
        """Called periodically while the record could not be read at start: once Redis
        answers, the record of the version the fleet serves gives its source, so workers
        that restart on older weights can be caught up (without it they could not: seen in
        the fault campaign, a scheduler restarted while Redis was down, then both workers
        killed, left a step with no worker for 120 s)."""
        if not self._record_unread:
            return
        try:
            record = await self.core.log.load_serving()
        except RecordUnreadable:
            return
        self._record_unread = False
        if record is not None and record[0] == self.core.policy_version and self.source[0] != record[0]:
            self.source = record
            self.core.serving.catchable = self.store.path(record[1]) is not None
            log.info("serving version %d: its record read at last (workers that lag can be caught up)", record[0])

    def _ack(self) -> common_pb2.WeightUpdateResponse:
        version = self.core.policy_version
        return common_pb2.WeightUpdateResponse(version=version, num_workers_updated=sum(
            w.policy_version == version for w in self.core.workers.usable()))


class _WorkerCall:
    """One worker's weight call, and why the scheduler gave up on it, if it did."""

    def __init__(self, worker: WorkerHandle, call):
        self.worker = worker
        self.task = asyncio.ensure_future(call)
        self.why = ""

    @property
    def ended(self) -> bool:
        return self.task.done()

    @property
    def response(self) -> common_pb2.WeightUpdateResponse | None:
        t = self.task
        return t.result() if t.done() and not t.cancelled() and t.exception() is None else None

    def give_up(self, why: str) -> None:
        self.why = why
        self.task.cancel()

    def failure(self) -> str:
        """What went wrong, in words (for the log and the trainer's error)."""
        t = self.task
        if self.why:
            return self.why
        if t.cancelled():
            return "its call was cancelled (its connection closed)"
        if not t.done():
            return "no answer"
        err = t.exception()
        if err is None:
            return "it ended its stream before the last chunk"
        if isinstance(err, grpc.aio.AioRpcError):
            return f"{err.code().name}: {err.details()}"
        return f"{type(err).__name__}: {err}"

    def verdict(self) -> grpc.aio.AioRpcError | None:
        """The worker's refusal of the payload itself, if that is how it ended."""
        t = self.task
        err = t.exception() if t.done() and not t.cancelled() and not self.why else None
        return err if isinstance(err, grpc.aio.AioRpcError) and err.code() in _VERDICTS else None


class _Feed(_WorkerCall):
    """A worker's PushWeights stream, fed chunk by chunk from a small queue. Feeding
    never waits on a worker whose call has ended (a worker killed, its channel closed
    under the push): that wait was a push that never returned (docs/smollm2.md). A
    worker that takes no chunk for ``stall_s`` (stopped, wedged) is given up on."""

    def __init__(self, worker: WorkerHandle, push, first: common_pb2.WeightChunk, stall_s: float):
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=4)
        self.stall_s = stall_s
        super().__init__(worker, push(_forward(first, self.queue)))
        self.task.add_done_callback(self._end_requests)

    def _end_requests(self, _task) -> None:
        """Once the call has ended (answered, failed, cancelled), so does its request
        stream. gRPC reads it in a task of its own, which a call that ended early (a
        worker killed or refusing mid-stream) left waiting on this queue for good: it
        was destroyed pending when collected, and the stream (``_forward``), closed
        while it still ran, failed again ("aclose(): asynchronous generator is already
        running"), both logged as asyncio ERRORs."""
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queue.put_nowait(_END)

    async def put(self, item) -> None:
        if self.ended:
            return
        if not self.queue.full():
            self.queue.put_nowait(item)
            return
        put = asyncio.ensure_future(self.queue.put(item))
        try:
            await asyncio.wait((put, self.task), timeout=self.stall_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            took = put.done()
            if not took:
                put.cancel()
        if not took and not self.ended:
            self.give_up(f"took no chunk for {self.stall_s:g} s")


async def _end_all(calls: list[_WorkerCall]) -> None:
    """Cancels the calls still running (a push that ends short: each worker keeps its
    version) and waits until they have ended."""
    for c in calls:
        if not c.ended:
            c.task.cancel()
    await asyncio.gather(*(c.task for c in calls), return_exceptions=True)


def _no_worker_took(version: int, calls: list[_WorkerCall]) -> RhymerlError:
    """The trainer's error when no worker took ``version``: a worker's refusal of the
    payload as it is (same code, its message naming the field), else UNAVAILABLE naming
    every worker and what happened to it (the SDK retries it)."""
    for c in calls:
        if (err := c.verdict()) is not None:
            return _as_error(err)
    what = "; ".join(f"{c.worker.worker_id}: {c.failure()}" for c in calls)
    return Unavailable(f"no worker took version {version} ({what}); the previous version keeps serving")


async def check_header(first: common_pb2.WeightChunk | None) -> None:
    """Refuses a push's first message as a worker would (INVALID_ARGUMENT naming the
    field), with the workers' own check: ``weight_receiver.receive``, given the header
    alone, checks it, then finds the data missing (DATA_LOSS: the header passed).
    Stricter on one point: the SHA-256 must be hex (no payload could match another), as
    the weight store names its files by it."""
    async def header_only():
        yield first
    try:
        async with contextlib.aclosing(header_only()) as chunks:
            await weight_receiver.receive(chunks, MAX_WEIGHT_BYTES)
    except DataLoss:
        pass  # the header passed; the data is the rest of the push
    if not _HEX.issuperset(first.header.sha256):
        raise InvalidArgument("must be a hex SHA-256 (64 characters)", "header.sha256")


async def _forward(first: common_pb2.WeightChunk, q: asyncio.Queue) -> AsyncIterator[common_pb2.WeightChunk]:
    yield first
    while (item := await q.get()) is not _END:
        yield item


async def _paced(chunks: AsyncIterator[common_pb2.WeightChunk], stall_s: float
                 ) -> AsyncIterator[common_pb2.WeightChunk]:
    """The trainer's chunks; a trainer that sends none for ``stall_s`` (while the push
    holds new steps back) ends the push instead of holding the fleet forever."""
    it = aiter(chunks)
    while True:
        try:
            chunk = await asyncio.wait_for(anext(it, _END), stall_s)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"no chunk came from the trainer for {stall_s:g} s; the push is abandoned and "
                                   "the previous version keeps serving", "data") from None
        if chunk is _END:
            return
        yield chunk


async def _drain(header: common_pb2.WeightHeader, chunks: AsyncIterator[common_pb2.WeightChunk],
                 incoming: Incoming | None) -> None:
    """Reads a re-sent payload to its end (into the store when it lacks it) and checks it
    is the one announced."""
    digest, size = hashlib.sha256(), 0
    async for chunk in chunks:
        if incoming is not None:
            await incoming.write(chunk.data)
        digest.update(chunk.data)
        size += len(chunk.data)
        if size > header.total_bytes:
            raise InvalidArgument(f"more than total_bytes ({header.total_bytes}) received", "data")
    if size != header.total_bytes or digest.hexdigest() != header.sha256.lower():
        raise DataLoss(f"re-push of version {header.version} incomplete or corrupt "
                       f"({size} of {header.total_bytes} bytes)", "header.sha256")


def _as_error(err: grpc.aio.AioRpcError) -> RhymerlError:
    """Re-raises a worker's status to the trainer with the same code."""
    exc = RhymerlError(err.details())  # the worker's message names the field
    exc.code = err.code()
    return exc
