"""The scheduler's side of WorkerService: a Run stream as typed events, and the calls
the watchdog and the weight fan-out make.

The core sees only ``Chunk`` in and ``ChunkDone`` / ``ChunkFailed`` / ``RunEnded`` out;
gRPC status codes become a ``RunOutcome`` here, in one place. Tests drive the core with
in-process fake workers that yield the same events.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from rhymerl.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from services.common.grpc_server import channel
from services.common.security import TLSConfig
from services.scheduler.policies.base import RequestKey
from services.scheduler.workers import WorkerHandle


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sample's next chunk of work."""

    dispatch_id: str  # unique per chunk: a late result of an earlier chunk is recognisable
    key: RequestKey
    prompt_token_ids: list[int]
    generated_token_ids: list[int]  # earlier chunks' tokens: the worker re-prefills them
    sampling: common_pb2.SamplingParams  # seed = the sample's own seed
    max_new_tokens: int
    num_samples: int  # the prompt's group size in its step (siblings share a draft index)


@dataclass(frozen=True, slots=True)
class ChunkDone:
    dispatch_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: int  # common_pb2.FinishReason; UNSPECIFIED: the budget ended, more to go
    policy_version: int
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ChunkFailed:
    """The engine failed on this chunk alone; the other chunks of the Run go on."""

    dispatch_id: str
    error: str


class RunOutcome(enum.Enum):
    DONE = "done"  # every chunk reported
    REJECTED = "rejected"  # the worker refused the input: no retry can help
    ENGINE_FAILED = "engine_failed"  # counts as an attempt; the worker lives on
    WRONG_VERSION = "wrong_version"  # it serves another policy version
    LOST = "lost"  # gone, draining or unreachable: run the chunks elsewhere


@dataclass(frozen=True, slots=True)
class RunEnded:
    outcome: RunOutcome
    error: str = ""


LinkEvent = ChunkDone | ChunkFailed | RunEnded

# How long a reset channel's calls may still run (``reset``): past every bound those calls
# have of their own, so in practice until they end.
RESET_GRACE_S = 3600.0

_OUTCOMES = {grpc.StatusCode.INVALID_ARGUMENT: RunOutcome.REJECTED,
             grpc.StatusCode.FAILED_PRECONDITION: RunOutcome.WRONG_VERSION}


def outcome(code: grpc.StatusCode, details: str) -> RunOutcome:
    """What a Run call's status means. INTERNAL counts against the samples only when the
    worker's servicer raised it (``services/common/errors.py`` words it so); a worker
    killed mid-stream also surfaces as UNKNOWN or INTERNAL from the transport, and a
    crash is no fault of the samples it ran."""
    if code == grpc.StatusCode.INTERNAL and (details or "").startswith("internal error in "):
        return RunOutcome.ENGINE_FAILED
    return _OUTCOMES.get(code, RunOutcome.LOST)


class GrpcWorkerLink:
    """Channels to the workers (one per worker, opened on first use), each with its stub:
    building a stub binds every method of the service anew, which the scheduler would
    otherwise pay on every Run call and every watchdog poll."""

    def __init__(self, tls: TLSConfig | None = None):
        self.tls = tls
        # worker_id -> (address, channel, stub); the stub goes with its channel
        self._channels: dict[str, tuple[str, grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub]] = {}
        self._closing: dict[grpc.aio.Channel, asyncio.Task] = {}  # reset channels, until their calls end

    def stub(self, worker: WorkerHandle) -> worker_pb2_grpc.WorkerServiceStub:
        known = self._channels.get(worker.worker_id)
        if known is None or known[0] != worker.address:
            if known is not None:  # it moved: the old channel would only wait out its backoff
                asyncio.ensure_future(known[1].close())
            ch = channel(worker.address, self.tls)
            known = self._channels[worker.worker_id] = (worker.address, ch, worker_pb2_grpc.WorkerServiceStub(ch))
        return known[2]

    async def run(self, worker: WorkerHandle, policy_version: int, chunks: list[Chunk]) -> AsyncIterator[LinkEvent]:
        """Sends ``chunks`` in one Run call; yields each result, then one RunEnded."""
        request = worker_pb2.RunRequest(policy_version=policy_version, items=[
            worker_pb2.WorkItem(request_id=c.dispatch_id, step_id=c.key.step_id, prompt_id=c.key.prompt_id,
                                sample_index=c.key.sample_index, prompt_token_ids=c.prompt_token_ids,
                                generated_token_ids=c.generated_token_ids, sampling=c.sampling,
                                max_new_tokens=c.max_new_tokens, num_samples=c.num_samples) for c in chunks])
        try:
            async for r in self.stub(worker).Run(request):
                if r.error:
                    yield ChunkFailed(r.request_id, r.error)
                else:
                    yield ChunkDone(r.request_id, list(r.token_ids), list(r.logprobs), r.finish_reason,
                                    r.policy_version, r.spec.num_verify_steps, r.spec.num_draft_tokens,
                                    r.spec.num_accepted_tokens)
        except grpc.RpcError as err:
            yield RunEnded(outcome(err.code(), err.details()), f"{err.code().name}: {err.details()}")
            return
        yield RunEnded(RunOutcome.DONE)

    async def abort(self, worker: WorkerHandle, dispatch_ids: list[str]) -> None:
        """Best effort: a worker that cannot be reached has dropped them anyway."""
        try:
            await self.stub(worker).Abort(worker_pb2.AbortRequest(request_ids=dispatch_ids), timeout=10)
        except grpc.RpcError:
            pass

    async def stats(self, worker: WorkerHandle, timeout_s: float = 5.0) -> worker_pb2.WorkerStats:
        return await self.stub(worker).GetWorkerStats(worker_pb2.WorkerStatsRequest(), timeout=timeout_s)

    async def probe(self, address: str) -> worker_pb2.WorkerStats:
        """Asks a worker that is not registered (a statically configured one) for its stats."""
        ch = channel(address, self.tls)
        try:
            return await worker_pb2_grpc.WorkerServiceStub(ch).GetWorkerStats(
                worker_pb2.WorkerStatsRequest(), timeout=5)
        finally:
            await ch.close()

    def reset(self, worker_id: str) -> None:
        """The worker came back (likely a new process): the next call opens a fresh
        channel instead of waiting out the old one's reconnect backoff. The calls still
        on the old channel are left to end by themselves: a worker that was only slow to
        answer (marked unhealthy, then back) goes on taking a weight push on it, which
        closing the channel cut short (docs/smollm2.md: the push that never returned);
        to a new process they fail at once. Each such call has its own bound (the weight
        fan-out's stall bound, the others' deadlines), and keepalive ends any call whose
        peer went silent."""
        known = self._channels.pop(worker_id, None)
        if known is not None:
            ch = known[1]
            self._closing[ch] = asyncio.ensure_future(ch.close(grace=RESET_GRACE_S))
            self._closing[ch].add_done_callback(lambda _: self._closing.pop(ch, None))

    async def forget(self, worker_id: str) -> None:
        known = self._channels.pop(worker_id, None)
        if known is not None:
            await known[1].close()

    async def close(self) -> None:
        for worker_id in list(self._channels):
            await self.forget(worker_id)
        for ch, task in list(self._closing.items()):  # reset channels whose calls still run: end them now
            task.cancel()
            await ch.close()
