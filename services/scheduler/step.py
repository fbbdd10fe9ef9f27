"""One submitted step: its samples' progress and the append-only log of its events.

The log is what makes SubmitStep idempotent: a re-submission (a trainer's
retry) replays the log from the start and then follows it live, so every
(prompt, sample) is delivered exactly once per stream and never generated twice.
A finished step keeps only its log (the samples' progress is released).

The log holds each event serialized (a bytes object): what a kept step costs is then
what ``num_bytes`` counts, about its serialized size, where a protobuf message object
per sample costs many times its serialized size in the scheduler's memory.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass

from rhymerl.v1 import common_pb2, rollout_pb2

from services.common import packed
from services.common.packed import varint
from services.scheduler.policies.base import Request
from services.scheduler.worker_link import step_fields


MAX_BATCH_BYTES = 1 << 20  # of a StepEvent.samples batch (gRPC's default limit is 4 MiB a message)
_SAMPLE_KEY = 0x0A  # the first byte of a serialized StepEvent.sample event (field 1, length-delimited)


def retained_size(encoded: bytes) -> int:
    """What keeping one serialized event costs in memory: the bytes object (header and
    data, rounded up to the allocator's 16-byte blocks) and its slot in the list."""
    return (sys.getsizeof(encoded) + 15) // 16 * 16 + 8


def fingerprint(request: rollout_pb2.SubmitStepRequest) -> str:
    """Content hash of a step request (deterministic serialization)."""
    return hashlib.sha256(request.SerializeToString(deterministic=True)).hexdigest()


@dataclass(slots=True)
class SampleProgress:
    """Tokens and counters of one sample, accumulated over its chunks. Tokens and logprobs
    are the workers' packed bytes, concatenated, never decoded (``services/common/packed.py``)."""

    request: Request
    prompt_field: bytes  # the WorkItem's prompt fields, shared by the prompt's samples (``worker_link.prompt_field``)
    # its seed (``ids.sample_seed``) as the varint every WorkItem of it and its SampleResult carry, encoded once
    # (63 bits: nine bytes, each chunk's encoding and the result's would otherwise make them again)
    seed_varint: bytes
    token_ids: bytes = b""  # packed int32 varints
    num_tokens: int = 0
    logprobs: bytes = b""  # float32 little-endian
    version: int = -1  # the policy version of its first tokens (-1: none yet)
    versions: list[list[int]] | None = None  # [policy version, tokens] runs, only once a second version came
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    done: bool = False
    num_failures: int = 0  # its chunks that failed (a worker crash, an engine error)
    error: str = ""  # why the service gave it up (finish reason ABORT)
    dispatch_id: str | None = None  # the chunk in flight; a result for any other is stale
    run: StepRun | None = None  # its step (set by the StepRun)

    @property
    def seed(self) -> int:
        return packed.read_varint(self.seed_varint)


class StepRun:
    """State of one step; the scheduler core fills it, SubmitStep streams read it.

    Args:
        request: the trainer's request (kept until the step finishes).
        samples: one progress per (prompt, sample), from the intake.
    """

    def __init__(self, request: rollout_pb2.SubmitStepRequest, samples: list[SampleProgress]):
        self.step_id = request.step_id
        self.fingerprint = fingerprint(request)
        self.request: rollout_pb2.SubmitStepRequest | None = request
        self.sampling = request.sampling
        self._logprobs = self.sampling.logprobs  # read per sample
        self.n = request.n
        # Its samples until they go to the policy (then the core's index of unfinished
        # samples is the only one: a finished sample's progress is released, its event
        # holds it; a second index per step would cost a dict entry per sample).
        self.to_hand_over: list[SampleProgress] = samples
        for s in samples:
            s.run = self
        self.prompt_ids = {s.request.prompt_id for s in samples}
        self.num_samples = len(samples)
        self.num_done = 0  # samples finished (their results may still be on the way to the log)
        self.num_published = 0  # samples in ``events``: the last one closes the step
        self.num_running = 0  # chunks in flight
        self.aborted: set[tuple[str, int]] = set()  # (prompt_id, sample_index) that ended as ABORT
        self._encoded: list[bytes] = []  # the events, serialized
        self.num_bytes = 0  # what keeping the events costs in memory (``retained_size``)
        self.finished = asyncio.Event()
        self.num_followers = 0  # streams following it now (SubmitStep calls, joined ones too)
        self.unfollowed_since: float | None = time.monotonic()  # since when none has (None: one does)
        self._changed = asyncio.Condition()
        self.history_hit_rate = 0.0
        self.cancelled = False
        self.abort_error = ""  # why the service ended it early (empty: the trainer cancelled it)
        self.closing = False  # its summary is being written
        self.in_policy = False  # its requests were handed to the policy (not held for a push)
        self.step_fields = step_fields(self.sampling, self.step_id, self.n)  # every WorkItem's part of the step
        self._step_id_field = packed.field(1, self.step_id.encode())  # every SampleResult's
        # over the published samples (the summary's figures, without decoding the log)
        self.num_generated_tokens = 0
        self.spec = [0, 0, 0]  # num_verify_steps, num_draft_tokens, num_accepted_tokens

    fingerprint_of = staticmethod(fingerprint)

    @property
    def is_finished(self) -> bool:
        return self.finished.is_set()

    @property
    def num_unfinished(self) -> int:
        return self.num_samples - self.num_done

    def has_sample(self, prompt_id: str, sample_index: int) -> bool:
        return 0 <= sample_index < self.n and prompt_id in self.prompt_ids

    @property
    def num_events(self) -> int:
        return len(self._encoded)

    @property
    def events(self) -> list[rollout_pb2.StepEvent]:
        """The events so far, decoded (a copy)."""
        return [rollout_pb2.StepEvent.FromString(e) for e in self._encoded]

    def sample_results(self) -> list[rollout_pb2.SampleResult]:
        return [e.sample for e in self.events if e.HasField("sample")]

    def record(self, events: Iterable[rollout_pb2.StepEvent | bytes]) -> None:
        """Appends to the log (``publish`` also wakes the streams); an event may come
        serialized already."""
        encoded = [e if isinstance(e, bytes) else e.SerializeToString() for e in events]
        self._encoded.extend(encoded)
        self.num_bytes += sum(map(retained_size, encoded))

    async def publish(self, events: list[rollout_pb2.StepEvent | bytes], last: bool = False) -> None:
        async with self._changed:
            self.record(events)
            if last:
                self.finished.set()
                self.request = None
                self.to_hand_over = []  # only the log is kept: it holds every sample
            self._changed.notify_all()

    def _followed(self) -> None:
        self.num_followers += 1
        self.unfollowed_since = None

    def _unfollowed(self) -> None:
        self.num_followers -= 1
        if not self.num_followers:
            self.unfollowed_since = time.monotonic()

    async def follow(self) -> AsyncIterator[rollout_pb2.StepEvent]:
        """Every event from the first, then live ones until the summary."""
        i = 0
        self._followed()
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: i < len(self._encoded))
                    batch = self._encoded[i:]
                for event in batch:
                    yield rollout_pb2.StepEvent.FromString(event)
                i += len(batch)
                if self.is_finished and i == len(self._encoded):
                    return
        finally:
            self._unfollowed()

    async def follow_batched(self) -> AsyncIterator[bytes]:
        """``follow``'s events as they are kept, serialized, the samples that are there
        together joined into StepEvent.samples batches (what SubmitStep sends: a message
        per sample costs grpc.aio more than the sample). A kept sample event is
        ``StepEvent.sample``'s field, which is also a SampleBatch's ``samples`` element,
        so a batch is the events' bytes behind one key and length."""
        i = 0
        self._followed()
        try:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: i < len(self._encoded))
                    events = self._encoded[i:]
                i += len(events)
                batch: list[bytes] = []
                size = 0
                for event in events:
                    if event[0] != _SAMPLE_KEY or size + len(event) > MAX_BATCH_BYTES:
                        if batch:
                            yield packed.field(3, b"".join(batch))  # StepEvent.samples
                            batch, size = [], 0
                    if event[0] != _SAMPLE_KEY:
                        yield event
                        continue
                    batch.append(event)
                    size += len(event)
                if batch:
                    yield packed.field(3, b"".join(batch))
                if self.is_finished and i == len(self._encoded):
                    return
        finally:
            self._unfollowed()

    def encode_sample(self, s: SampleProgress, policy_version: int) -> bytes:
        """The sample's SampleResult, serialized by splicing: its scalar fields encoded
        here, the packed payloads as they came from the workers (the rare per-token
        versions of a sample that spans several versions through protobuf)."""
        return b"".join(self._sample_parts(s, policy_version))

    def encode_event(self, s: SampleProgress, policy_version: int) -> bytes:
        """``StepEvent(sample=...)`` serialized: ``encode_sample`` behind the event's key
        and length, in one allocation (what the step keeps per sample)."""
        parts = self._sample_parts(s, policy_version)
        return b"".join((b"\x0a", varint(sum(map(len, parts))), *parts))  # StepEvent.sample

    def _sample_parts(self, s: SampleProgress, policy_version: int) -> tuple[bytes, ...]:
        request = s.request
        version = policy_version if s.version < 0 else s.version
        tail = b""
        if s.versions is not None:
            version = min(v for v, _ in s.versions)
            tail = rollout_pb2.SampleResult(
                token_policy_versions=[v for v, count in s.versions for _ in range(count)]).SerializeToString()
        spec = b"\x4a\x00"  # spec is always set, as protobuf writes an empty SpecCounters
        if s.num_verify_steps or s.num_draft_tokens or s.num_accepted_tokens:
            spec = packed.field(9, common_pb2.SpecCounters(
                num_verify_steps=s.num_verify_steps, num_draft_tokens=s.num_draft_tokens,
                num_accepted_tokens=s.num_accepted_tokens).SerializeToString())
        index, reason, migrations, seed = request.sample_index, s.finish_reason, request.num_migrations, s.seed_varint
        tokens, logprobs = s.token_ids, s.logprobs if self._logprobs else b""
        prompt_id = request.prompt_id.encode()
        return (
            self._step_id_field, b"\x12", varint(len(prompt_id)), prompt_id,
            b"\x18" + varint(index) if index else b"",
            b"\x22" + varint(len(tokens)) if tokens else b"", tokens,  # the payloads spliced as they are
            b"\x2a" + varint(len(logprobs)) if logprobs else b"", logprobs,
            b"\x30" + varint(reason) if reason else b"",
            b"\x38" + varint(version) if version else b"", tail, spec,
            b"\x50" + varint(migrations) if migrations else b"",
            b"\x58" + seed if seed != b"\x00" else b"",  # a seed of 0 is omitted, as protobuf does
            packed.field(12, s.error.encode()) if s.error else b"")
