"""The trainer's reports over real gRPC on loopback (the scheduler server, a fake worker
on a Link stream): ReportRewards while the history service is down is UNAVAILABLE naming
it (the SDK retries that), never INTERNAL with a traceback in the scheduler's log; a
ReportLogprobs "logprob" above 0 is INVALID_ARGUMENT naming the sample and the token."""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import asynccontextmanager

import grpc
from rhymerl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc, worker_pb2, worker_pb2_grpc

from benchmarks.fake_fleet import FleetSpec, make_servicer
from services.common.grpc_server import Server
from services.common.redis_server import free_port
from tests.aio import run_async

TOKENS = 3  # the fake worker's samples: 3 tokens, each of logprob -0.5


@asynccontextmanager
async def one_step(**settings):
    """A scheduler (``settings``) with one fake worker, after step "s" (prompt "p", n=2)."""
    from services.scheduler.server import start_scheduler
    from services.scheduler.settings import SchedulerSettings

    worker = Server([(worker_pb2_grpc.add_WorkerServiceServicer_to_server,
                      make_servicer("w", FleetSpec("unused:1", 1, response_tokens=TOKENS), Counter()))],
                    ["rhymerl.v1.WorkerService"])
    await worker.start("127.0.0.1", 0)
    _, port, stop = await start_scheduler(SchedulerSettings(
        host="127.0.0.1", port=0, metrics_port=0, health_port=0, policy="rhymerl", **settings))
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await worker_pb2_grpc.RegistryServiceStub(ch).Register(worker_pb2.RegisterRequest(
                worker_id="w", address=f"127.0.0.1:{worker.port}", max_num_seqs=8, vocab_size=32_000,
                max_model_len=8_192), timeout=30)
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            events = [e async for e in stub.SubmitStep(rollout_pb2.SubmitStepRequest(
                step_id="s", n=2, sampling=common_pb2.SamplingParams(max_tokens=8, seed=5, logprobs=True),
                prompts=[common_pb2.Prompt(prompt_id="p", token_ids=[7, 8, 9])]), timeout=60)]
            assert events[-1].summary.num_samples == 2
            yield stub
    finally:
        await stop()
        await worker.stop(0)


async def failure(call) -> grpc.aio.AioRpcError:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the call succeeded")


def test_rewards_with_history_down_are_unavailable_naming_history_without_an_error_logged(caplog):
    caplog.set_level(logging.INFO)

    @run_async
    async def main():
        async with one_step(history_address=f"127.0.0.1:{free_port()}") as stub:  # nothing listens there
            caplog.clear()
            err = await failure(stub.ReportRewards(rollout_pb2.ReportRewardsRequest(step_id="s", rewards=[
                rollout_pb2.SampleReward(prompt_id="p", sample_index=0, reward=1.0)]), timeout=60))
            assert err.code() == grpc.StatusCode.UNAVAILABLE, (err.code(), err.details())
            assert "history service" in err.details() and "retry" in err.details()
            reported = [r for r in caplog.records if "ReportRewards" in r.getMessage() or r.exc_info]
            assert not [r for r in reported if r.levelno >= logging.ERROR or r.exc_info], \
                [r.getMessage() for r in reported]

    main()


@run_async
async def test_a_positive_logprob_is_invalid_argument_naming_the_sample_and_token():
    def report(*logprobs):
        return rollout_pb2.ReportLogprobsRequest(step_id="s", samples=[
            rollout_pb2.SampleLogprobs(prompt_id="p", sample_index=k, logprobs=lps) for k, lps in enumerate(logprobs)])

    async with one_step(history_address="") as stub:
        err = await failure(stub.ReportLogprobs(report([-0.5] * TOKENS, [-0.5, 3.0, -0.5]), timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("samples[1].logprobs[1]: a logprob is at most 0"), err.details()
        err = await failure(stub.ReportLogprobs(report([-0.5, -0.5, float("nan")]), timeout=30))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.details().startswith("samples[0].logprobs[2]: logprobs must be finite"), err.details()
        answer = await stub.ReportLogprobs(report([-0.5] * TOKENS, [-0.5, 1e-6, -0.5]), timeout=30)
        assert answer.step.num_samples == 2 and answer.step.num_tokens == 2 * TOKENS  # nothing of the others kept
