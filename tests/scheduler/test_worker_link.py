"""The scheduler's side of WorkerService: what a stream's status and a result's refusal
mean for its samples, the link's channels and stubs, batching on the Link stream, and the
token payloads it moves as bytes (spliced, never decoded; malformed ones refused)."""

from __future__ import annotations

import asyncio
import math
import struct
from collections import Counter

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rhymerl.v1 import common_pb2, rollout_pb2, worker_pb2, worker_pb2_grpc

from benchmarks.fake_fleet import FleetSpec, make_servicer
from services.common import packed
from services.common.grpc_server import Server
from services.scheduler.policies.base import Request, RequestKey, WorkerState
from services.scheduler.step import SampleProgress, StepRun
from services.scheduler.worker_link import (Chunk, ChunkDone, ChunkFailed, GrpcWorkerLink, RunEnded, RunOutcome,
                                            encode_batch, encode_batches, events_of, outcome, prompt_field,
                                            step_fields)
from services.scheduler.workers import WorkerHandle
from tests.aio import run_async

SAMPLING = common_pb2.SamplingParams(max_tokens=8, temperature=1.0, logprobs=True)


def test_only_the_workers_own_failures_count_against_the_samples():
    code = grpc.StatusCode
    assert outcome(code.INTERNAL, "internal error in WorkerServicer.Link: RuntimeError: boom") \
        is RunOutcome.ENGINE_FAILED
    # A worker killed mid-stream: the transport's words, not the samples' fault.
    assert outcome(code.UNKNOWN, "Stream removed") is RunOutcome.LOST
    assert outcome(code.INTERNAL, "Received RST_STREAM with error code 2") is RunOutcome.LOST
    assert outcome(code.UNAVAILABLE, "Socket closed") is RunOutcome.LOST
    assert outcome(code.INVALID_ARGUMENT, "items[0].sampling.top_p: must be in [0, 1]") is RunOutcome.REJECTED
    assert outcome(code.FAILED_PRECONDITION, "policy_version: ...") is RunOutcome.WRONG_VERSION


def chunk(dispatch_id: str, index: int = 0, generated: list[int] = (), prompt: list[int] = (5, 6),
          seed: int = 7, sampling: common_pb2.SamplingParams = SAMPLING) -> Chunk:
    return Chunk(dispatch_id, RequestKey("s", "p", index), prompt_field("p", list(prompt)),
                 packed.pack_token_ids(list(generated)), len(generated), sampling, packed.varint(seed),
                 sampling.max_tokens - len(generated), step_fields(sampling, "s", 3))


async def fake_workers(names, response_tokens: int = 3):
    counts: Counter = Counter()
    servers = []
    for worker_id in names:
        server = Server([(worker_pb2_grpc.add_WorkerServiceServicer_to_server,
                          make_servicer(worker_id, FleetSpec("unused:1", 1, response_tokens=response_tokens),
                                        counts))], ["rhymerl.v1.WorkerService"])
        await server.start("127.0.0.1", 0)
        servers.append(server)
    return counts, servers


async def drain(stream, num_chunks: int) -> list:
    """Reads the stream's batches until ``num_chunks`` results came."""
    batches, seen = [], 0
    events = stream.events()
    while seen < num_chunks:
        batch = await anext(events)
        assert not isinstance(batch, RunEnded), batch
        batches.append(batch)
        seen += len(batch)
    return batches


@run_async
async def test_one_stub_per_worker_channel_dropped_with_it():
    """Over real gRPC (two fake workers of the control-plane benchmark): the stub is built
    once per channel, not per call; a worker that moved gets a new channel and stub and
    its old channel is closed; a forgotten worker's next call opens afresh."""
    counts, servers = await fake_workers(("first", "second"))
    link = GrpcWorkerLink()
    try:
        w = WorkerHandle("w", f"127.0.0.1:{servers[0].port}", WorkerState(worker_id="w", capacity=4))
        stub = link.stub(w)
        assert (await link.stats(w)).worker_id == "first"
        stream = link.open(w)
        stream.send(0, [chunk("d0")])
        (done,), = await drain(stream, 1)
        assert isinstance(done, ChunkDone) and done.num_tokens == 3 and len(done.logprobs) == 12
        stream.close()
        assert link.stub(w) is stub and counts["batches"] == 1 and counts["stats"] == 1

        old_channel = link._channels["w"][1]
        w.address = f"127.0.0.1:{servers[1].port}"  # restarted elsewhere
        moved = link.stub(w)
        assert moved is not stub and (await link.stats(w)).worker_id == "second"
        while old_channel.get_state() is not grpc.ChannelConnectivity.SHUTDOWN:
            await asyncio.sleep(0.01)

        await link.forget("w")
        assert "w" not in link._channels
        assert link.stub(w) is not moved and (await link.stats(w)).worker_id == "second"
    finally:
        await link.close()
        for server in servers:
            await server.stop(0)


@run_async
async def test_batches_queued_together_go_as_one_message_and_come_back_as_one():
    """Three batches sent before the stream takes any go to the worker as one LinkRequest
    (one message, every item), and the worker's answers come back as one batch; a later
    batch is a message of its own on the same stream."""
    counts, (server,) = await fake_workers(("only",))
    link = GrpcWorkerLink()
    try:
        w = WorkerHandle("w", f"127.0.0.1:{server.port}", WorkerState(worker_id="w", capacity=16))
        stream = link.open(w)
        for first in (0, 3, 6):
            stream.send(0, [chunk(f"d{i}", index=i) for i in range(first, first + 3)])
        batches = await drain(stream, 9)
        assert counts["batches"] == 1 and counts["items"] == 9
        assert [len(b) for b in batches] == [9]
        assert sorted(e.dispatch_id for e in batches[0]) == sorted(f"d{i}" for i in range(9))
        stream.send(0, [chunk("late")])
        (late,), = await drain(stream, 1)
        assert late.dispatch_id == "late" and counts["batches"] == 2
        stream.close()
    finally:
        await link.close()
        await server.stop(0)


@run_async
async def test_no_link_message_exceeds_the_limit_however_much_is_queued(monkeypatch):
    """Batches too large for one message go as several, each within LINK_MESSAGE_BYTES
    (gRPC's own limit is 256 MiB: a larger message failed the stream, and the batch was
    re-queued to fail again forever; a step with millions of stop tokens hung so), and
    queued batches merge only up to it; every item arrives, at its version."""
    from services.scheduler import worker_link

    one = len(encode_batch(2, [chunk("d0", prompt=list(range(1000)))]))
    limit = 3 * one + 32  # three items (a sample index adds a few bytes to each)
    monkeypatch.setattr(worker_link, "LINK_MESSAGE_BYTES", limit)
    batches = encode_batches(2, [chunk(f"d{i}", index=i, prompt=list(range(1000))) for i in range(10)])
    assert len(batches) == 4 and all(len(b) <= limit for b in batches)
    requests = [worker_pb2.LinkRequest.FromString(b) for b in batches]
    assert all(r.policy_version == 2 for r in requests)
    assert [i.request_id for r in requests for i in r.items] == [f"d{i}" for i in range(10)]

    counts, (server,) = await fake_workers(("only",))
    link = GrpcWorkerLink()
    try:
        w = WorkerHandle("w", f"127.0.0.1:{server.port}", WorkerState(worker_id="w", capacity=64))
        stream = link.open(w)
        for first in (0, 10):  # queued before the stream takes any: they would merge
            stream.send(0, [chunk(f"d{i}", index=i, prompt=list(range(1000))) for i in range(first, first + 10)])
        batches = await drain(stream, 20)
        assert counts["items"] == 20 and counts["batches"] >= 7
        assert sorted(e.dispatch_id for b in batches for e in b) == sorted(f"d{i}" for i in range(20))
        stream.close()
    finally:
        await link.close()
        await server.stop(0)


def test_a_work_item_is_spliced_exactly():
    """The WorkItem the scheduler splices from bytes parses as the one protobuf would
    build: prompt, the earlier chunks' tokens, the sample's seed over the step's."""
    sampling = common_pb2.SamplingParams(max_tokens=40, temperature=0.7, top_k=5, seed=99, logprobs=True)
    c = chunk("inc-17", index=2, generated=[0, 127, 128, 2**31 - 1, 300], prompt=[1, 2, 70000], seed=2**63 + 5,
              sampling=sampling)
    request = worker_pb2.LinkRequest.FromString(encode_batch(4, [c, chunk("other", index=0)]))
    assert request.policy_version == 4 and len(request.items) == 2
    item = request.items[0]
    assert (item.request_id, item.prompt_id, item.sample_index, item.step_id, item.num_samples) == \
        ("inc-17", "p", 2, "s", 3)
    assert list(item.prompt_token_ids) == [1, 2, 70000]
    assert list(item.generated_token_ids) == [0, 127, 128, 2**31 - 1, 300]
    assert item.max_new_tokens == 35 and item.sampling.seed == 2**63 + 5
    assert (item.sampling.max_tokens, item.sampling.top_k, item.sampling.logprobs) == (40, 5, True)
    assert math.isclose(item.sampling.temperature, 0.7, rel_tol=1e-6)
    assert request.items[1].sample_index == 0 and not request.items[1].generated_token_ids


token_lists = st.lists(st.integers(0, 2**31 - 1), max_size=40)
float32s = st.floats(width=32, allow_nan=False)


@settings(max_examples=60, deadline=None)
@given(chunks=st.lists(st.tuples(token_lists, st.data()), min_size=1, max_size=5), logprobs=st.booleans())
def test_tokens_and_logprobs_pass_through_exactly(chunks, logprobs):
    """A sample's chunks, as workers send them (a LinkResponse on the wire), through the
    scheduler (events, progress, the resumed chunk's WorkItem, the trainer's SampleResult):
    the token ids and the logprobs come out bit for bit, never decoded on the way."""
    request = rollout_pb2.SubmitStepRequest(step_id="s", n=1, sampling=common_pb2.SamplingParams(
        max_tokens=1000, logprobs=logprobs))
    prog = SampleProgress(Request("s", "p", 0, prompt_len=2, max_tokens=1000), prompt_field("p", [5, 6]), packed.varint(3))
    run = StepRun(request, [prog])
    all_tokens, all_logprobs = [], []
    for tokens, data in chunks:
        lps = data.draw(st.lists(float32s, min_size=len(tokens), max_size=len(tokens))) if logprobs else []
        wire = worker_pb2.LinkResponse(results=[worker_pb2.ChunkResult(
            request_id="d", packed_token_ids=packed.pack_token_ids(tokens), num_tokens=len(tokens),
            packed_logprobs=packed.pack_logprobs(lps), policy_version=1)]).SerializeToString()
        (done,) = events_of(worker_pb2.LinkResponse.FromString(wire))
        assert isinstance(done, ChunkDone) and done.num_tokens == len(tokens)
        prog.token_ids += done.token_ids
        prog.logprobs += done.logprobs
        prog.num_tokens += done.num_tokens
        all_tokens += tokens
        all_logprobs += lps
        resumed = Chunk("next", prog.request.key, prog.prompt_field, prog.token_ids, prog.num_tokens, run.sampling,
                        prog.seed_varint, 1, run.step_fields)
        item = worker_pb2.LinkRequest.FromString(encode_batch(0, [resumed])).items[0]
        assert list(item.generated_token_ids) == all_tokens and list(item.prompt_token_ids) == [5, 6]
    sample = rollout_pb2.SampleResult.FromString(run.encode_sample(prog, 1))
    assert list(sample.token_ids) == all_tokens
    assert struct.pack(f"<{len(all_logprobs)}f", *sample.logprobs) == struct.pack(f"<{len(all_logprobs)}f",
                                                                                  *all_logprobs)
    assert (sample.step_id, sample.prompt_id, sample.seed) == ("s", "p", 3)
    assert packed.unpack_token_ids(prog.token_ids) == all_tokens


def _result(**fields) -> worker_pb2.LinkResponse:
    return worker_pb2.LinkResponse(results=[worker_pb2.ChunkResult(request_id="d", **fields)])


@pytest.mark.parametrize("fields, words", [
    (dict(packed_token_ids=packed.pack_token_ids([1, 2, 3]), num_tokens=2), "packed_token_ids: 3 token ids"),
    (dict(packed_token_ids=packed.pack_token_ids([300])[:1], num_tokens=1), "packed_token_ids: not a sequence"),
    (dict(packed_token_ids=b"\x80" * 11 + b"\x01", num_tokens=1), "packed_token_ids: not a sequence"),
    (dict(packed_token_ids=packed.pack_token_ids([1, 2]), num_tokens=2, packed_logprobs=b"\0" * 7),
     "packed_logprobs: 7 bytes for 2 tokens"),
    (dict(num_tokens=-1), "num_tokens: -1 is negative"),
])
def test_a_malformed_result_is_that_chunks_failure_naming_the_field(fields, words):
    (failed,) = events_of(_result(**fields))
    assert isinstance(failed, ChunkFailed) and failed.outcome is RunOutcome.ENGINE_FAILED
    assert failed.error.startswith("malformed chunk result: ") and words in failed.error


def test_refusals_and_failures_map_to_outcomes():
    cases = {worker_pb2.REFUSAL_INVALID_ARGUMENT: RunOutcome.REJECTED, worker_pb2.REFUSAL_DRAINING: RunOutcome.LOST,
             worker_pb2.REFUSAL_WRONG_VERSION: RunOutcome.WRONG_VERSION}
    for refusal, expected in cases.items():
        (failed,) = events_of(_result(refusal=refusal, error="why"))
        assert isinstance(failed, ChunkFailed) and failed.outcome is expected and failed.error == "why"
    (failed,) = events_of(_result(error="RuntimeError: boom"))
    assert failed.outcome is RunOutcome.ENGINE_FAILED


@settings(max_examples=60, deadline=None)
@given(index=st.integers(0, 2**31 - 1), seed=st.integers(0, 2**64 - 1), reason=st.sampled_from([0, 1, 2, 3]),
       migrations=st.integers(0, 1000), error=st.text(max_size=20), spec=st.tuples(*[st.integers(0, 2**40)] * 3),
       runs=st.lists(st.tuples(st.integers(0, 2**40), st.integers(1, 5)), max_size=4),
       logprobs=st.booleans(), prompt_id=st.text(min_size=1, max_size=10))
def test_a_spliced_sample_result_parses_as_the_one_protobuf_builds(index, seed, reason, migrations, error, spec,
                                                                     runs, logprobs, prompt_id):
    """Every field of the SampleResult the scheduler splices, against protobuf's own."""
    request = rollout_pb2.SubmitStepRequest(step_id="step/é", n=1, sampling=common_pb2.SamplingParams(
        max_tokens=1000, logprobs=logprobs))
    r = Request("step/é", prompt_id, index, prompt_len=2, max_tokens=1000)
    r.num_migrations = migrations
    tokens = [t for v, count in runs for t in range(count)]
    prog = SampleProgress(r, b"", packed.varint(seed), token_ids=packed.pack_token_ids(tokens), num_tokens=len(tokens),
                          logprobs=packed.pack_logprobs([-1.25] * len(tokens)), finish_reason=reason, error=error,
                          num_verify_steps=spec[0], num_draft_tokens=spec[1], num_accepted_tokens=spec[2])
    versions = [v for v, count in runs for _ in range(count)]
    if runs:
        prog.version = runs[0][0]
        if len(set(versions)) > 1:
            prog.versions = [list(run) for run in runs]
    run = StepRun(request, [prog])
    expected = rollout_pb2.SampleResult(
        step_id="step/é", prompt_id=prompt_id, sample_index=index, token_ids=tokens,
        logprobs=[-1.25] * len(tokens) if logprobs else [], finish_reason=reason,
        policy_version=min(versions) if versions else 7,
        token_policy_versions=versions if len(set(versions)) > 1 else [],
        spec=common_pb2.SpecCounters(num_verify_steps=spec[0], num_draft_tokens=spec[1], num_accepted_tokens=spec[2]),
        num_migrations=migrations, seed=seed, error=error)
    assert rollout_pb2.SampleResult.FromString(run.encode_sample(prog, 7)) == expected
    event = run.encode_event(prog, 7)  # what the step keeps: the same, as a StepEvent, in one piece
    assert rollout_pb2.StepEvent.FromString(event) == rollout_pb2.StepEvent(sample=expected)
    assert packed.payload(event) == run.encode_sample(prog, 7)
