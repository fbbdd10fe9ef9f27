"""Fans a weight update out to every worker, keeping the fleet on one version.

A push is streamed through: each chunk from the trainer is forwarded to every worker
as it arrives (the scheduler never holds the whole model). Workers check size,
SHA-256 and finiteness themselves and switch only when the payload is complete.

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

from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument, RhymerlError, Unavailable
from services.scheduler.core import SchedulerCore
from services.scheduler.step_log import RecordUnreadable
from services.scheduler.weight_store import Incoming, WeightStore
from services.scheduler.workers import WorkerHandle

log = logging.getLogger(__name__)
MODES = ("after_steps", "between_chunks")
_END = object()


class WeightFanout:
    def __init__(self, core: SchedulerCore, mode: str = "after_steps", store: WeightStore | None = None):
        if mode not in MODES:
            raise ValueError(f"weight update mode must be one of {MODES}, got {mode!r}")
        self.core, self.mode = core, mode
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
        first = await anext(aiter(chunks), None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("the first message must be a header", "header")
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
                    queues = [asyncio.Queue(maxsize=4) for _ in workers]
                    calls = [asyncio.ensure_future(self.core.link.stub(w).PushWeights(_forward(first, q)))
                             for w, q in zip(workers, queues)]
                    try:
                        async for chunk in chunks:
                            if chunk.HasField("header"):
                                raise InvalidArgument("only the first message may be a header", "header")
                            if incoming is not None:
                                await incoming.write(chunk.data)
                            await asyncio.gather(*(q.put(chunk) for q in queues))
                    except BaseException:
                        for call in calls:  # the workers' streams end short: each keeps its version
                            call.cancel()
                        await asyncio.gather(*calls, return_exceptions=True)
                        raise
                    for q in queues:
                        await q.put(_END)
                    response = await self._finish(header.version, workers, calls, sha256=sha256)
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
                calls = [asyncio.ensure_future(self.core.link.stub(w).LoadWeights(request)) for w in workers]
                return await self._finish(request.version, workers, calls, path=request.path)

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
            worker.policy_version = response.version
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

    async def _finish(self, version: int, workers: list[WorkerHandle], calls, *, sha256: str = "",
                      path: str = "") -> common_pb2.WeightUpdateResponse:
        results = await asyncio.gather(*calls, return_exceptions=True)
        errors = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
        for w, r in zip(workers, results):
            if not isinstance(r, BaseException):
                w.policy_version = r.version
        if len(errors) == len(workers):
            err = errors[0][1]
            raise _as_error(err) if isinstance(err, grpc.aio.AioRpcError) else err
        for w, err in errors:
            log.error("worker %s did not take version %d (%s); it gets no work until updated",
                      w.worker_id, version, err)
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


async def _forward(first: common_pb2.WeightChunk, q: asyncio.Queue) -> AsyncIterator[common_pb2.WeightChunk]:
    yield first
    while (item := await q.get()) is not _END:
        yield item


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
