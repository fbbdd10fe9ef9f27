"""The scheduler's side of WorkerService: one long-lived Link stream per worker, as typed
events, and the calls the watchdog and the weight fan-out make.

The core sees only ``Chunk`` in and batches of ``ChunkDone`` / ``ChunkFailed`` and one
final ``RunEnded`` out; gRPC status codes and refusals become a ``RunOutcome`` here, in
one place. Token payloads are bytes here (``services/common/packed.py``): a chunk's
WorkItem is spliced from bytes the scheduler keeps, never decoded, and a result's tokens
and logprobs are passed on as they came, their framing checked. Tests drive the core
with in-process fake links that yield the same events.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from rhymerl.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from services.common import packed
from services.common.packed import varint
from services.common.grpc_server import channel
from services.common.security import TLSConfig
from services.scheduler.policies.base import RequestKey
from services.scheduler.workers import WorkerHandle

LINK_METHOD = "/rhymerl.v1.WorkerService/Link"


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ costs several times more
class Chunk:
    """One sample's next chunk of work."""

    dispatch_id: str  # unique per chunk: a late result of an earlier chunk is recognisable
    key: RequestKey
    prompt_field: bytes  # WorkItem's prompt_id and prompt_token_ids fields, encoded (per prompt)
    generated: bytes  # earlier chunks' tokens, packed (the worker re-prefills them)
    num_generated: int
    sampling: common_pb2.SamplingParams  # the step's (its seed is not the sample's)
    seed_varint: bytes  # the sample's own seed, as a varint (``SampleProgress.seed_varint``)
    max_new_tokens: int
    step_fields: tuple[bytes, bytes]  # ``step_fields``: the step's part of the WorkItem

    @property
    def seed(self) -> int:
        return packed.read_varint(self.seed_varint)


@dataclass(slots=True)
class ChunkDone:
    dispatch_id: str
    token_ids: bytes  # packed (``packed.pack_token_ids``)
    num_tokens: int
    logprobs: bytes  # float32 little-endian; empty when off
    finish_reason: int  # common_pb2.FinishReason; UNSPECIFIED: the budget ended, more to go
    policy_version: int
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class RunOutcome(enum.Enum):
    DONE = "done"  # every chunk reported
    REJECTED = "rejected"  # the worker refused the input: no retry can help
    ENGINE_FAILED = "engine_failed"  # counts as an attempt; the worker lives on
    WRONG_VERSION = "wrong_version"  # it serves another policy version
    LOST = "lost"  # gone, draining or unreachable: run the chunks elsewhere


@dataclass(frozen=True, slots=True)
class ChunkFailed:
    """The worker did not give this chunk's tokens; the other chunks go on. ``outcome``:
    ENGINE_FAILED (the engine failed on it, or its result was malformed: an attempt),
    REJECTED (invalid input), LOST (the worker drains) or WRONG_VERSION."""

    dispatch_id: str
    error: str
    outcome: RunOutcome = RunOutcome.ENGINE_FAILED


@dataclass(frozen=True, slots=True)
class RunEnded:
    """The stream ended; its chunks that did not report never will."""

    outcome: RunOutcome
    error: str = ""


LinkEvent = ChunkDone | ChunkFailed
_REFUSALS = {worker_pb2.REFUSAL_INVALID_ARGUMENT: RunOutcome.REJECTED,
             worker_pb2.REFUSAL_DRAINING: RunOutcome.LOST,
             worker_pb2.REFUSAL_WRONG_VERSION: RunOutcome.WRONG_VERSION}

# How long a reset channel's calls may still run (``reset``): past every bound those calls
# have of their own, so in practice until they end.
RESET_GRACE_S = 3600.0

_OUTCOMES = {grpc.StatusCode.INVALID_ARGUMENT: RunOutcome.REJECTED,
             grpc.StatusCode.FAILED_PRECONDITION: RunOutcome.WRONG_VERSION}


def outcome(code: grpc.StatusCode, details: str) -> RunOutcome:
    """What a stream's status means. INTERNAL counts against the samples only when the
    worker's servicer raised it (``services/common/errors.py`` words it so); a worker
    killed mid-stream also surfaces as UNKNOWN or INTERNAL from the transport, and a
    crash is no fault of the samples it ran."""
    if code == grpc.StatusCode.INTERNAL and (details or "").startswith("internal error in "):
        return RunOutcome.ENGINE_FAILED
    return _OUTCOMES.get(code, RunOutcome.LOST)


def step_fields(sampling: common_pb2.SamplingParams, step_id: str, num_samples: int) -> tuple[bytes, bytes]:
    """A step's part of every WorkItem, encoded once: (its step_id and num_samples
    fields, its sampling serialized: the sample's seed is appended to it, and the last
    value of a field wins)."""
    return (worker_pb2.WorkItem(step_id=step_id, num_samples=num_samples).SerializeToString(),
            sampling.SerializeToString())


def prompt_field(prompt_id: str, token_ids: list[int]) -> bytes:
    """A prompt's part of every WorkItem: prompt_id and prompt_token_ids, encoded once."""
    return worker_pb2.WorkItem(prompt_id=prompt_id, prompt_token_ids=token_ids).SerializeToString()


def encode_item(c: Chunk) -> bytes:
    """A WorkItem, spliced: the chunk's own fields, the prompt's and the step's (in one
    join: each ``+`` would copy what is built so far)."""
    fixed, sampling = c.step_fields
    seed = c.seed_varint
    dispatch_id = c.dispatch_id.encode()
    index, generated = c.key.sample_index, c.generated
    return b"".join((
        b"\x0a", varint(len(dispatch_id)), dispatch_id, c.prompt_field,  # request_id, prompt_id, prompt_token_ids
        b"\x18" + varint(index) if index else b"",  # sample_index
        packed.header(5, len(generated)) if generated else b"", generated,  # generated_token_ids
        b"\x32", varint(len(sampling) + 1 + len(seed)), sampling, b"\x30", seed,  # sampling, its seed the sample's
        b"\x38", varint(c.max_new_tokens), fixed))


# Most bytes of one LinkRequest (a batch, or the batches merged into one message), well
# under gRPC's message limit (grpc_server.MAX_MESSAGE_BYTES): a larger message fails the
# stream, the worker is marked lost, and its batch re-queued only to fail again, forever.
LINK_MESSAGE_BYTES = 64 * 1024 * 1024


def encode_batch(policy_version: int, chunks: list[Chunk]) -> bytes:
    """A LinkRequest of ``chunks``, serialized."""
    return b"".join(encode_batches(policy_version, chunks, limit=0))


def encode_batches(policy_version: int, chunks: list[Chunk], limit: int | None = None) -> list[bytes]:
    """``chunks`` as serialized LinkRequests of at most ``limit`` bytes each (None:
    LINK_MESSAGE_BYTES; 0: no limit; one item alone may be larger), what ``send`` puts on
    the stream."""
    limit = (LINK_MESSAGE_BYTES if limit is None else limit) or float("inf")
    parts = []
    for c in chunks:
        item = encode_item(c)
        parts += (b"\x0a", varint(len(item)), item)  # items
    version = b"\x10" + varint(policy_version) if policy_version > 0 else b""
    parts.append(version)
    whole = b"".join(parts)
    if len(whole) <= limit:
        return [whole]
    batches, batch, size = [], [], len(version)  # (rare: split between items)
    for k in range(0, len(parts) - 1, 3):
        n = len(parts[k + 1]) + len(parts[k + 2]) + 1
        if batch and size + n > limit:
            batches.append(b"".join(batch) + version)
            batch, size = [], len(version)
        batch += parts[k:k + 3]
        size += n
    batches.append(b"".join(batch) + version)
    return batches


def events_of(response: worker_pb2.LinkResponse) -> list[LinkEvent]:
    """A batch of results as events; a malformed result is that chunk's failure."""
    events: list[LinkEvent] = []
    for r in response.results:
        if r.refusal:
            events.append(ChunkFailed(r.request_id, r.error or worker_pb2.Refusal.Name(r.refusal),
                                      _REFUSALS.get(r.refusal, RunOutcome.ENGINE_FAILED)))
        elif r.error:
            events.append(ChunkFailed(r.request_id, r.error))
        else:
            tokens, num, logprobs = r.packed_token_ids, r.num_tokens, r.packed_logprobs
            wrong = packed.check(tokens, num, logprobs)
            if wrong:
                events.append(ChunkFailed(r.request_id, f"malformed chunk result: {wrong}"))
                continue
            if r.HasField("spec"):  # a drafter's counters (a worker without one sends none)
                spec = r.spec
                events.append(ChunkDone(r.request_id, tokens, num, logprobs, r.finish_reason, r.policy_version,
                                        spec.num_verify_steps, spec.num_draft_tokens, spec.num_accepted_tokens))
            else:
                events.append(ChunkDone(r.request_id, tokens, num, logprobs, r.finish_reason, r.policy_version))
    return events


class LinkStream:
    """One worker's Link stream: ``send`` and ``abort`` queue batches (several queued
    before the stream takes them go as one message), ``events`` yields the results a
    batch at a time and then one ``RunEnded``; ``close`` cancels the call."""

    def __init__(self, method):
        self._outbox: deque[tuple[int | None, bytes]] = deque()  # (policy version or None: aborts, batch)
        self._ready = asyncio.Event()
        self._call = method(self._requests())

    def send(self, policy_version: int, chunks: list[Chunk]) -> None:
        for batch in encode_batches(policy_version, chunks):
            self._outbox.append((policy_version, batch))
        self._ready.set()

    def abort(self, dispatch_ids: list[str]) -> None:
        self._outbox.append((None, worker_pb2.LinkRequest(abort_request_ids=dispatch_ids).SerializeToString()))
        self._ready.set()

    async def _requests(self) -> AsyncIterator[bytes]:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._outbox:  # consecutive batches of one version (and aborts) merge
                version, batch = self._outbox.popleft()
                parts, size = [batch], len(batch)
                while self._outbox and self._outbox[0][0] in (version, None) \
                        and size + len(self._outbox[0][1]) <= LINK_MESSAGE_BYTES:
                    size += len(self._outbox[0][1])
                    parts.append(self._outbox.popleft()[1])
                yield b"".join(parts)

    async def events(self) -> AsyncIterator[list[LinkEvent] | RunEnded]:
        """The results a batch at a time. A parsed response is dropped before its events
        are yielded: the consumer may wait (its samples' delivery) while holding them,
        and with every stream's batch waiting at once (a 512-worker fleet answering
        together) the parsed messages would double what the waiting batches cost."""
        try:
            while (response := await self._call.read()) is not grpc.aio.EOF:
                events = events_of(response)
                del response
                yield events
        except grpc.RpcError as err:
            yield RunEnded(outcome(err.code(), err.details()), f"{err.code().name}: {err.details()}")
            return
        yield RunEnded(RunOutcome.DONE)

    def close(self) -> None:
        self._call.cancel()


class GrpcWorkerLink:
    """Channels to the workers (one per worker, opened on first use), each with its stub
    and its Link method: building a stub binds every method of the service anew, which
    the scheduler would otherwise pay on every stream and every watchdog poll."""

    def __init__(self, tls: TLSConfig | None = None):
        self.tls = tls
        # worker_id -> (address, channel, stub, Link method); stub and method go with their channel
        self._channels: dict[str, tuple[str, grpc.aio.Channel, worker_pb2_grpc.WorkerServiceStub, object]] = {}
        self._closing: dict[grpc.aio.Channel, asyncio.Task] = {}  # reset channels, until their calls end

    def _known(self, worker: WorkerHandle) -> tuple:
        known = self._channels.get(worker.worker_id)
        if known is None or known[0] != worker.address:
            if known is not None:  # it moved: the old channel would only wait out its backoff
                asyncio.ensure_future(known[1].close())
            ch = channel(worker.address, self.tls)
            # requests go as the bytes ``encode_batch`` spliced; responses are parsed (upb)
            link = ch.stream_stream(LINK_METHOD, request_serializer=bytes,
                                    response_deserializer=worker_pb2.LinkResponse.FromString)
            known = self._channels[worker.worker_id] = (worker.address, ch, worker_pb2_grpc.WorkerServiceStub(ch),
                                                        link)
        return known

    def stub(self, worker: WorkerHandle) -> worker_pb2_grpc.WorkerServiceStub:
        return self._known(worker)[2]

    def open(self, worker: WorkerHandle) -> LinkStream:
        """A new Link stream to ``worker`` (on its cached channel)."""
        return LinkStream(self._known(worker)[3])

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
