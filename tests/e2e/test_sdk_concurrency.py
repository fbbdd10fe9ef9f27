"""One SDK client shared by threads, or by asyncio.gather: every call gets its own step's
summary. The SDK once kept a call's summary on the client (``last_summary``), where the
streams of the other calls overwrote it before ``rollout`` read it (some results had
None, some another step's summary).

The server is a scripted RolloutService over loopback gRPC that makes the overlap happen
by design, not by luck: every step's stream stays open for a while after its summary, so
other steps' summaries (and starts) land between a call's summary and the end of its
stream, when the old SDK read the shared attribute.
"""

from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import pytest
from rhymerl import AsyncRolloutClient, Prompt, RolloutClient, SamplingParams
from rhymerl.v1 import rollout_pb2, rollout_pb2_grpc

from services.common.redis_server import free_port

pytestmark = pytest.mark.timeout(120)

NUM_STEPS = 96
THREADS = 16
HOLD_S = 0.03  # the stream stays open this long after its summary


def step_index(step_id: str) -> int:
    return int(step_id.rsplit("-", 1)[1])


class SummaryThenHold(rollout_pb2_grpc.RolloutServiceServicer):
    """Each step: one sample per prompt, its summary (naming the step, num_samples = the
    step's index), then the stream held open ``HOLD_S`` before it ends. Every other step
    also waits a little before its summary, so the summaries of concurrent steps are
    spread over each other's hold windows."""

    def SubmitStep(self, request, context):  # noqa: N802 - gRPC's name
        index = step_index(request.step_id)
        yield rollout_pb2.StepEvent(samples=rollout_pb2.SampleBatch(samples=[
            rollout_pb2.SampleResult(step_id=request.step_id, prompt_id=p.prompt_id, sample_index=0,
                                     token_ids=[index % 90 + 2], finish_reason=1)
            for p in request.prompts]))
        if index % 2:
            time.sleep(HOLD_S / 2)
        yield rollout_pb2.StepEvent(summary=rollout_pb2.StepSummary(
            step_id=request.step_id, num_samples=index, policy="scripted"))
        time.sleep(HOLD_S)


@pytest.fixture(scope="module")
def address():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=THREADS * 2))
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(SummaryThenHold(), server)
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def step_prompts(index: int) -> list[Prompt]:
    return [Prompt(f"q{index}", [2, 3, index % 90 + 2])]


def check_own(step_id: str, result) -> None:
    """The result is its own step's: samples and summary."""
    assert result.summary is not None, f"{step_id}: no summary"
    assert (result.summary.step_id, result.summary.num_samples) == (step_id, step_index(step_id)), \
        f"{step_id} got the summary of {result.summary.step_id}"
    assert [s.step_id for s in result.samples] == [step_id]


def test_threads_sharing_a_client_each_get_their_own_summary(address):
    ids = [f"thread-step-{i}" for i in range(NUM_STEPS)]
    with RolloutClient(address, timeout_s=60, max_retries=0) as client:
        with futures.ThreadPoolExecutor(THREADS) as pool:
            results = list(pool.map(
                lambda sid: client.rollout(sid, step_prompts(step_index(sid)), n=1, sampling=SamplingParams()), ids))
        wrong = [(sid, r.summary and r.summary.step_id) for sid, r in zip(ids, results)
                 if r.summary is None or r.summary.step_id != sid]
        assert not wrong, f"{len(wrong)} of {len(ids)} results had another step's summary or none: {wrong[:5]}"
        for sid, result in zip(ids, results):
            check_own(sid, result)
        # last_summary: the summary of a call that finished (whichever ended last), never None
        assert client.last_summary is not None and client.last_summary.step_id in ids


def test_concurrent_submit_step_streams_carry_their_own_summary(address):
    ids = [f"stream-step-{i}" for i in range(NUM_STEPS // 2)]

    def one(sid: str):
        stream = client.submit_step(sid, step_prompts(step_index(sid)), n=1)
        samples = list(stream)
        return samples, stream.summary

    with RolloutClient(address, timeout_s=60, max_retries=0) as client:
        with futures.ThreadPoolExecutor(THREADS) as pool:
            got = list(pool.map(one, ids))
    for sid, (samples, summary) in zip(ids, got):
        assert [s.step_id for s in samples] == [sid]
        assert summary is not None and summary.step_id == sid, (sid, summary and summary.step_id)


def test_asyncio_gather_on_one_client_gives_each_call_its_own_summary(address):
    ids = [f"async-step-{i}" for i in range(NUM_STEPS)]

    async def main():
        async with AsyncRolloutClient(address, timeout_s=60, max_retries=0) as client:
            results = await asyncio.gather(*(
                client.rollout(sid, step_prompts(step_index(sid)), n=1, sampling=SamplingParams()) for sid in ids))
            return results, client.last_summary

    results, last = asyncio.run(main())
    wrong = [(sid, r.summary and r.summary.step_id) for sid, r in zip(ids, results)
             if r.summary is None or r.summary.step_id != sid]
    assert not wrong, f"{len(wrong)} of {len(ids)} results had another step's summary or none: {wrong[:5]}"
    for sid, result in zip(ids, results):
        check_own(sid, result)
    assert last is not None and last.step_id in ids


def test_concurrent_async_streams_carry_their_own_summary(address):
    ids = [f"async-stream-{i}" for i in range(THREADS * 2)]

    async def main():
        async with AsyncRolloutClient(address, timeout_s=60, max_retries=0) as client:
            async def one(sid):
                stream = client.submit_step(sid, step_prompts(step_index(sid)), n=1)
                return [x async for x in stream], stream.summary

            return await asyncio.gather(*(one(sid) for sid in ids))

    for sid, (samples, summary) in zip(ids, asyncio.run(main())):
        assert [s.step_id for s in samples] == [sid]
        assert summary is not None and summary.step_id == sid, (sid, summary and summary.step_id)


def test_a_call_stopped_early_leaves_last_summary_to_the_calls_that_finished(address):
    """A stream closed before its end sets no summary anywhere; one read to its end does."""
    with RolloutClient(address, timeout_s=60, max_retries=0) as client:
        stream = client.submit_step("closed-step-1", step_prompts(1), n=1)
        next(stream)
        stream.close()
        assert stream.summary is None and client.last_summary is None
        done = client.rollout("done-step-2", step_prompts(2), n=1)
        assert client.last_summary == done.summary and done.summary.step_id == "done-step-2"

