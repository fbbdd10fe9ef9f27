"""The scheduler core over real Link streams (gRPC on loopback, in-process workers): a
stream that breaks mid-batch re-queues exactly the chunks it had not reported, and a
worker that sends malformed payloads costs its chunks an attempt, never the scheduler."""

from __future__ import annotations

from collections import Counter

import grpc
from rhymerl.v1 import common_pb2, rollout_pb2, worker_pb2, worker_pb2_grpc

from benchmarks.fake_fleet import FleetSpec, make_servicer
from services.common import packed
from services.common.grpc_server import Server
from services.scheduler.core import SchedulerCore
from services.scheduler.policies import make_policy
from services.scheduler.worker_link import GrpcWorkerLink
from services.scheduler.workers import WorkerTable
from tests.aio import run_async
from tests.scheduler.fake_workers import collect

TOKENS = 3  # every sample: one chunk of 3 tokens


class Breaker(worker_pb2_grpc.WorkerServiceServicer):
    """Answers the first ``answer`` items of its first batch (as the fake fleet would),
    in one message, then breaks the stream."""

    def __init__(self, answer: int):
        self.answer = answer
        self.received: list[str] = []
        self.answered: list[str] = []
        self.fake = make_servicer("breaker", FleetSpec("unused:1", 1, response_tokens=TOKENS), Counter())

    async def Link(self, request_iterator, context):
        async for batch in request_iterator:
            self.received += [item.request_id for item in batch.items]
            items = batch.items[:self.answer]
            self.answered += [item.request_id for item in items]
            yield worker_pb2.LinkResponse(results=[self.fake._answer(item, batch.policy_version) for item in items])
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: the worker went away mid-batch")


class Garbler(worker_pb2_grpc.WorkerServiceServicer):
    """Answers every item with a payload whose framing is wrong (4 ids for 3 tokens)."""

    def __init__(self):
        self.items = 0

    async def Link(self, request_iterator, context):
        async for batch in request_iterator:
            self.items += len(batch.items)
            yield worker_pb2.LinkResponse(results=[worker_pb2.ChunkResult(
                request_id=item.request_id, packed_token_ids=packed.pack_token_ids([1, 2, 3, 4]), num_tokens=3,
                finish_reason=common_pb2.FINISH_REASON_STOP) for item in batch.items])


async def serve(servicer) -> Server:
    server = Server([(worker_pb2_grpc.add_WorkerServiceServicer_to_server, servicer)], ["rhymerl.v1.WorkerService"])
    await server.start("127.0.0.1", 0)
    return server


def step(step_id: str, num_prompts: int) -> rollout_pb2.SubmitStepRequest:
    return rollout_pb2.SubmitStepRequest(
        step_id=step_id, n=1, sampling=common_pb2.SamplingParams(max_tokens=8, logprobs=True, seed=5),
        prompts=[common_pb2.Prompt(prompt_id=f"p{i}", token_ids=[7, 8, i + 9]) for i in range(num_prompts)])


async def run_step(workers: list[tuple[str, Server]], num_prompts: int, **limits):
    from services.scheduler.core import CoreLimits

    core = SchedulerCore(make_policy("rhymerl", chunk_size=16), WorkerTable(), GrpcWorkerLink(),
                         limits=CoreLimits(**limits))
    for worker_id, server in workers:
        core.register(worker_id, f"127.0.0.1:{server.port}", 4, 0, 32_000, 8_192)
    core.start()
    try:
        run = await core.submit(step("s", num_prompts))
        samples, summary = await collect(run)
        return core, samples, summary
    finally:
        await core.stop()
        await core.link.close()


def fleet_tokens(sample: rollout_pb2.SampleResult) -> list[int]:
    return packed.unpack_token_ids(make_servicer("x", FleetSpec("unused:1", 1, response_tokens=TOKENS), Counter())
                                   ._answer(_item(sample), 0).packed_token_ids)


def _item(sample):
    return worker_pb2.WorkItem(request_id="x", sample_index=sample.sample_index, max_new_tokens=TOKENS,
                               sampling=common_pb2.SamplingParams(max_tokens=8))


@run_async
async def test_a_stream_that_breaks_mid_batch_requeues_exactly_its_unreported_chunks():
    counts: Counter = Counter()
    good = await serve(make_servicer("good", FleetSpec("unused:1", 1, response_tokens=TOKENS), counts))
    breaker = Breaker(answer=2)
    bad = await serve(breaker)
    try:
        core, samples, summary = await run_step([("breaker", bad), ("good", good)], num_prompts=8)
    finally:
        await good.stop(0)
        await bad.stop(0)
    assert len(breaker.received) == 4 and len(breaker.answered) == 2  # a batch of 4; 2 answered, then it broke
    keys = [(s.prompt_id, s.sample_index) for s in samples]
    assert len(keys) == len(set(keys)) == 8 and summary.num_samples == 8  # nothing lost, nothing twice
    assert all(s.finish_reason == common_pb2.FINISH_REASON_STOP and not s.error for s in samples)
    # exactly the 2 unreported chunks ran again: the good worker ran its own 4 and those 2
    assert counts["items"] == 8 - 2
    assert all(list(s.token_ids) == fleet_tokens(s) and list(s.logprobs) == [-0.5] * TOKENS for s in samples)
    assert not core.workers.workers["breaker"].state.healthy and core.runs.num_chunks == 0


@run_async
async def test_malformed_payloads_cost_attempts_with_a_clear_error_and_never_the_scheduler():
    garbler = Garbler()
    bad = await serve(garbler)
    try:
        core, samples, summary = await run_step([("garbler", bad)], num_prompts=3, max_attempts=2)
    finally:
        await bad.stop(0)
    assert garbler.items == 3 * 2  # each sample tried twice (max_attempts), then given up
    assert len(samples) == 3 and summary.num_samples == 3
    for s in samples:
        assert s.finish_reason == common_pb2.FINISH_REASON_ABORT and not s.token_ids
        assert "malformed chunk result: packed_token_ids: 4 token ids, but num_tokens is 3" in s.error
    assert core.workers.workers["garbler"].state.healthy  # its stream and the scheduler go on


@run_async
async def test_the_trainer_gets_samples_finished_together_in_one_message_and_the_sdk_reads_them():
    """The real scheduler server, a fake worker on a Link stream, the SDK's async client:
    every sample once with the worker's tokens and logprobs; on the wire the samples a
    worker batch finished come as one StepEvent.samples message, not one each."""
    from rhymerl import AsyncRolloutClient, Prompt, SamplingParams
    from rhymerl.types import event_samples
    from rhymerl.v1 import rollout_pb2_grpc

    from services.scheduler.server import start_scheduler
    from services.scheduler.settings import SchedulerSettings

    counts: Counter = Counter()
    worker = await serve(make_servicer("w", FleetSpec("unused:1", 1, response_tokens=TOKENS), counts))
    server, port, stop = await start_scheduler(SchedulerSettings(host="127.0.0.1", port=0, metrics_port=0,
                                                                 health_port=0, policy="rhymerl"))
    try:
        address = f"127.0.0.1:{port}"
        async with grpc.aio.insecure_channel(address) as ch:
            await worker_pb2_grpc.RegistryServiceStub(ch).Register(worker_pb2.RegisterRequest(
                worker_id="w", address=f"127.0.0.1:{worker.port}", max_num_seqs=64, vocab_size=32_000,
                max_model_len=8_192))
            request = step("wire", 4)
            request.n = 8
            raw = rollout_pb2_grpc.RolloutServiceStub(ch).SubmitStep(request)
            events = [e async for e in raw]
        assert events[-1].HasField("summary") and events[-1].summary.num_samples == 32
        on_wire = [event_samples(e) for e in events[:-1]]
        assert sum(map(len, on_wire)) == 32 and len(on_wire) < 32 and max(map(len, on_wire)) > 1
        async with AsyncRolloutClient(address, timeout_s=60) as client:
            result = await client.rollout("sdk", [Prompt(f"q{i}", [7, 8, i + 9]) for i in range(4)], n=8,
                                          sampling=SamplingParams(max_tokens=8, seed=5))
        assert len(result.samples) == 32 and len({s.key for s in result.samples}) == 32
        for s in result.samples:
            assert s.token_ids == fleet_tokens(s) and s.logprobs == [-0.5] * TOKENS and s.finish_reason == "stop"
        assert result.summary.num_samples == 32 and result.summary.num_generated_tokens == 32 * TOKENS
    finally:
        await stop()
        await worker.stop(0)
