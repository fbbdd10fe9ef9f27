"""Fans a weight update out to every worker, keeping the fleet on one version.

A push is streamed through: each chunk from the trainer is forwarded to every
worker as it arrives (the scheduler never holds the whole model). Workers check
size and SHA-256 themselves and switch only when the payload is complete, so an
interrupted or corrupt push leaves the previous version serving everywhere.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from rhymerl.v1 import common_pb2

from services.common import metrics
from services.common.errors import FailedPrecondition, InvalidArgument, RhymerlError, Unavailable
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.workers import WorkerHandle

log = logging.getLogger(__name__)
_END = object()


class WeightFanout:
    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher
        self._lock = asyncio.Lock()

    async def push(self, chunks: AsyncIterator[common_pb2.WeightChunk]) -> common_pb2.WeightUpdateResponse:
        first = await anext(aiter(chunks), None)
        if first is None or not first.HasField("header"):
            raise InvalidArgument("the first message must be a header", "header")
        header = first.header
        async with self._lock:
            workers = await self._prepare(header.version)
            queues = [asyncio.Queue(maxsize=4) for _ in workers]

            async def forward(q: asyncio.Queue) -> AsyncIterator[common_pb2.WeightChunk]:
                yield first
                while (item := await q.get()) is not _END:
                    yield item

            calls = [asyncio.ensure_future(w.stub.PushWeights(forward(q))) for w, q in zip(workers, queues)]
            try:
                async for chunk in chunks:
                    if chunk.HasField("header"):
                        raise InvalidArgument("only the first message may be a header", "header")
                    await asyncio.gather(*(q.put(chunk) for q in queues))
            except BaseException:
                # The trainer's stream broke: end the workers' streams short, so each
                # rejects the incomplete payload and keeps serving its version.
                for call in calls:
                    call.cancel()
                await asyncio.gather(*calls, return_exceptions=True)
                self.dispatcher.resume()
                raise
            for q in queues:
                await q.put(_END)
            return await self._finish(header.version, workers, calls)

    async def load(self, request: common_pb2.LoadWeightsRequest) -> common_pb2.WeightUpdateResponse:
        if not request.path:
            raise InvalidArgument("must be non-empty", "path")
        async with self._lock:
            workers = await self._prepare(request.version)
            calls = [asyncio.ensure_future(w.stub.LoadWeights(request)) for w in workers]
            return await self._finish(request.version, workers, calls)

    async def _prepare(self, version: int) -> list[WorkerHandle]:
        if version <= self.dispatcher.policy_version:
            raise FailedPrecondition(
                f"must be greater than the version serving ({self.dispatcher.policy_version})", "version")
        workers = self.dispatcher.workers.usable()
        if not workers:
            raise Unavailable("no rollout worker is registered and healthy")
        await self.dispatcher.exclusive()
        return workers

    async def _finish(self, version: int, workers: list[WorkerHandle], calls) -> common_pb2.WeightUpdateResponse:
        results = await asyncio.gather(*calls, return_exceptions=True)
        updated, errors = 0, []
        for w, res in zip(workers, results):
            if isinstance(res, BaseException):
                errors.append((w, res))
            else:
                w.policy_version = res.version
                updated += 1
        if updated == 0:
            self.dispatcher.resume()
            err = errors[0][1]
            if isinstance(err, grpc.aio.AioRpcError):
                raise _as_error(err)
            raise err
        for w, err in errors:
            log.error("worker %s did not take version %d (%s); it gets no work until updated",
                      w.worker_id, version, err)
        self.dispatcher.resume(version)
        metrics.weight_version.labels(component="scheduler").set(version)
        return common_pb2.WeightUpdateResponse(version=version, num_workers_updated=updated)


def _as_error(err: grpc.aio.AioRpcError) -> RhymerlError:
    """Re-raises a worker's status to the trainer with the same code."""
    exc = RhymerlError(f"worker rejected the update: {err.details()}")
    exc.code = err.code()
    return exc
