"""A step whose trainer went (its SubmitStep call ended: Ctrl-C without the SDK's cancel,
a crashed trainer, a deadline) is cancelled by the scheduler once no stream has followed it
for ``abandoned_step_timeout_s``, so it stops holding the workers; a trainer that stays
keeps its step running. Real services over loopback gRPC, a raw stub (no SDK cancel)."""

from __future__ import annotations

import time

import grpc
import pytest
from rhymerl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from tests.e2e.cluster import Cluster

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(model_dir, redis_url):
    c = Cluster(model_dir=model_dir, redis_url=redis_url,
                scheduler_settings={"abandoned_step_timeout_s": 0.2, "heartbeat_s": 0.2}).start()
    yield c
    c.stop()


def long_step(step_id: str, num_prompts: int = 4, max_tokens: int = 400) -> rollout_pb2.SubmitStepRequest:
    """Hundreds of tokens per sample on a CPU worker: still running long after the call ends."""
    return rollout_pb2.SubmitStepRequest(
        step_id=step_id, n=8, sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=3,
                                                                  ignore_eos=True),
        prompts=[common_pb2.Prompt(prompt_id=f"p{i}", token_ids=[2 + (7 * i + 3 * j) % 90 for j in range(6)])
                 for i in range(num_prompts)])


def test_a_step_whose_trainer_went_is_cancelled_and_frees_the_workers(cluster):
    with grpc.insecure_channel(cluster.address) as channel:
        call = rollout_pb2_grpc.RolloutServiceStub(channel).SubmitStep(long_step("gone"))
        cluster.wait_running("gone")
        call.cancel()  # the trainer's call ends; the step goes on, followed by nobody
    core = cluster.scheduler.core
    run = core.steps.get("gone")
    deadline = time.monotonic() + 60
    while not run.is_finished:  # a hang guard: the sweep cancels it within moments
        assert time.monotonic() < deadline, "an abandoned step ran on"
        time.sleep(0.02)
    assert run.cancelled and run.aborted, "it ran to its end: it was not cancelled"
    aborted = [s for s in run.sample_results() if s.finish_reason == common_pb2.FINISH_REASON_ABORT]
    assert aborted and all("abandoned_step_timeout_s" in s.error for s in aborted)
    deadline = time.monotonic() + 30
    while core.runs.num_chunks:
        assert time.monotonic() < deadline, "the cancelled step's chunks still run"
        time.sleep(0.02)


def test_a_followed_step_is_never_cancelled(cluster):
    """While a trainer's stream is open the step counts as followed: the sweep, and a
    cancel_abandoned however late, leave it alone; it runs to its end."""
    core = cluster.scheduler.core
    with grpc.insecure_channel(cluster.address) as channel:
        call = rollout_pb2_grpc.RolloutServiceStub(channel).SubmitStep(long_step("kept", 2))
        cluster.wait_running("kept")
        run = core.steps.get("kept")

        async def sweep_far_ahead():
            return run.num_followers, core.cancel_abandoned(time.monotonic() + 1e6)
        assert cluster.run(sweep_far_ahead()) == (1, [])
        events = list(call)
    assert events[-1].HasField("summary") and not run.cancelled and not run.aborted
    assert run.num_samples == 16 and run.num_followers == 0
