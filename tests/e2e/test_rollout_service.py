"""The rollout path end to end: SDK -> scheduler -> workers -> history, over real gRPC and Redis."""

from __future__ import annotations

import hashlib
import threading
import time

import grpc
import pytest
from rhymerl import Prompt, RolloutClient, SamplingParams
from rhymerl.v1 import common_pb2, rollout_pb2_grpc

from tests.e2e.cluster import TINY, Cluster, save_tiny_model

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(model_dir, redis_url):
    c = Cluster(model_dir=model_dir, redis_url=redis_url).start()
    yield c
    c.stop()


@pytest.fixture
def client(cluster):
    with RolloutClient(cluster.address, timeout_s=120, max_retries=2) as c:
        yield c


def prompts(k: int, length: int = 6, offset: int = 0) -> list[Prompt]:
    return [Prompt(f"p{offset + i}", [2 + (7 * (offset + i) + 3 * j) % 90 for j in range(length)]) for i in range(k)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, seed=1)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, max_tokens=24, seed=7)


def test_every_sample_returned_exactly_once_with_logprobs(client):
    """A step's (prompt, sample) pairs each come back once, with one logprob per token."""
    result = client.rollout("once", prompts(3), n=4, sampling=SAMPLED)
    keys = sorted(s.key for s in result.samples)
    assert keys == sorted((f"p{i}", k) for i in range(3) for k in range(4))
    for s in result.samples:
        assert 1 <= len(s.token_ids) <= 24
        assert len(s.logprobs) == len(s.token_ids)
        assert all(lp <= 0 for lp in s.logprobs)
        assert s.finish_reason in ("stop", "length")
    assert result.summary.num_samples == 12
    assert result.summary.num_generated_tokens == sum(len(s.token_ids) for s in result.samples)
    assert 0.0 <= result.summary.bubble_ratio <= 1.0


def test_seed_fixes_the_sample_regardless_of_placement(client):
    """Same seeds in two steps -> identical tokens, whichever worker/chunks ran them."""
    a = client.rollout("seed-a", prompts(2), n=3, sampling=SAMPLED)
    b = client.rollout("seed-b", prompts(2), n=3, sampling=SAMPLED)
    tokens = lambda r: {s.key: s.token_ids for s in r.samples}  # noqa: E731
    assert tokens(a) == tokens(b)
    c = client.rollout("seed-c", prompts(2), n=3, sampling=SamplingParams(**{**SAMPLED.__dict__, "seed": 8}))
    assert tokens(c) != tokens(a)


def test_resubmitted_step_returns_the_same_samples_without_regenerating(client, cluster):
    first = client.rollout("idem", prompts(2), n=2, sampling=SAMPLED)
    generated = cluster.scheduler.dispatcher.num_generated_tokens
    again = client.rollout("idem", prompts(2), n=2, sampling=SAMPLED)
    assert {s.key: s.token_ids for s in again.samples} == {s.key: s.token_ids for s in first.samples}
    assert cluster.scheduler.dispatcher.num_generated_tokens == generated


def test_step_id_reused_for_other_content_is_rejected(client):
    client.rollout("reuse", prompts(1), n=1, sampling=GREEDY)
    with pytest.raises(grpc.RpcError) as err:
        client.rollout("reuse", prompts(2), n=1, sampling=GREEDY)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "step_id" in err.value.details()


@pytest.mark.parametrize("change, field", [
    (dict(n=0), "n"),
    (dict(sampling=SamplingParams(temperature=-1.0)), "sampling.temperature"),
    (dict(sampling=SamplingParams(top_p=1.5)), "sampling.top_p"),
    (dict(sampling=SamplingParams(max_tokens=0)), "sampling.max_tokens"),
    (dict(sampling=SamplingParams(max_tokens=10_000)), "sampling.max_tokens"),
    (dict(prompts=[Prompt("bad", [5, 10_000])]), "prompts[0].token_ids"),
    (dict(prompts=[Prompt("empty", [])]), "prompts[0].token_ids"),
    (dict(prompts=[Prompt("dup", [3]), Prompt("dup", [4])]), "prompts[1].prompt_id"),
    (dict(step_id=""), "step_id"),
])
def test_bad_input_is_invalid_argument_naming_the_field(client, change, field):
    args = dict(step_id=f"bad-{field}-{len(str(change))}", prompts=prompts(1), n=1, sampling=GREEDY)
    args.update(change)
    with pytest.raises(grpc.RpcError) as err:
        client.rollout(**args)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)


def test_bad_input_does_not_disturb_work_in_flight(client, cluster):
    results = {}
    t = threading.Thread(target=lambda: results.update(r=client.rollout("busy", prompts(4), n=4, sampling=SAMPLED)))
    t.start()
    with RolloutClient(cluster.address, timeout_s=30) as other:
        with pytest.raises(grpc.RpcError):
            other.rollout("busy-bad", prompts(1), n=0, sampling=SAMPLED)
    t.join(120)
    assert len(results["r"].samples) == 16


def test_history_feeds_drafts_and_greedy_output_is_unchanged_by_speculation(client):
    """Epoch 2 of the same prompts drafts from epoch 1's rollouts: many drafts accepted,
    and the greedy tokens are the ones epoch 1 produced without any history."""
    ps = prompts(3, offset=100)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, seed=3, ignore_eos=True)
    first = client.rollout("epoch-1", ps, n=2, sampling=greedy)
    assert first.summary.history_hit_rate == 0.0
    second = client.rollout("epoch-2", ps, n=2, sampling=greedy)
    assert second.summary.history_hit_rate == 1.0
    assert {s.key: s.token_ids for s in second.samples} == {s.key: s.token_ids for s in first.samples}
    assert second.summary.num_accepted_tokens > 0.5 * second.summary.num_generated_tokens
    assert second.summary.num_verify_steps < first.summary.num_verify_steps


def test_rewards_are_recorded(client):
    client.rollout("rewarded", prompts(1), n=2, sampling=GREEDY)
    assert client.report_rewards("rewarded", [("p0", 0, 1.0), ("p0", 1, 0.0)]) == 2
    with pytest.raises(grpc.RpcError) as err:
        client.report_rewards("rewarded", [("p0", 5, 1.0)])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "rewards[0]" in err.value.details()


def test_cancel_aborts_unfinished_samples(client, cluster):
    long = SamplingParams(temperature=1.0, max_tokens=400, seed=5, ignore_eos=True)
    got = []

    def run():
        got.extend(client.submit_step("cancel-me", prompts(4, offset=200), n=8, sampling=long))

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.0)
    assert client.cancel_step("cancel-me") > 0
    t.join(60)
    assert len(got) == 32
    assert any(s.finish_reason == "abort" for s in got)


def test_weight_push_switches_version_and_corrupt_push_keeps_the_old_one(client, cluster, model_dir):
    from safetensors.torch import save

    from services.rollout.loader import init_random_model
    from services.rollout.models.config import ModelConfig

    before = client.rollout("w-before", prompts(2), n=2, sampling=GREEDY)
    data = save({k: v.contiguous() for k, v in init_random_model(ModelConfig(**TINY), seed=1).state_dict().items()})
    # Corrupt: checksum of other bytes.
    stub = rollout_pb2_grpc.RolloutServiceStub(grpc.insecure_channel(cluster.address))
    bad = [common_pb2.WeightChunk(header=common_pb2.WeightHeader(
        version=1, total_bytes=len(data), sha256=hashlib.sha256(b"x").hexdigest())),
        common_pb2.WeightChunk(data=data)]
    with pytest.raises(grpc.RpcError) as err:
        stub.PushWeights(iter(bad), timeout=60)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert client.stats().policy_version == 0
    # Interrupted: fewer bytes than announced.
    short = [bad[0], common_pb2.WeightChunk(data=data[: len(data) // 2])]
    short[0].header.sha256 = hashlib.sha256(data).hexdigest()
    with pytest.raises(grpc.RpcError) as err:
        stub.PushWeights(iter(short), timeout=60)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    again = client.rollout("w-still-0", prompts(2), n=2, sampling=GREEDY)
    assert {s.key: s.token_ids for s in again.samples} == {s.key: s.token_ids for s in before.samples}
    assert all(s.policy_version == 0 for s in again.samples)

    assert client.push_weights(1, data) == 1
    after = client.rollout("w-after", prompts(2), n=2, sampling=GREEDY)
    assert all(s.policy_version == 1 for s in after.samples)
    assert {s.key: s.token_ids for s in after.samples} != {s.key: s.token_ids for s in before.samples}
    assert all(w.policy_version == 1 for w in client.stats().workers)
    with pytest.raises(grpc.RpcError) as err:
        client.push_weights(1, data[:-1] + b"\0")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    # Back to the original weights by path (version must still increase).
    assert client.load_weights(2, str(model_dir)) == 2
    back = client.rollout("w-path", prompts(2), n=2, sampling=GREEDY)
    assert {s.key: s.token_ids for s in back.samples} == {s.key: s.token_ids for s in before.samples}


def test_a_lost_worker_loses_no_sample(model_dir, redis_url):
    """Kill a worker mid-step: its chunks are re-run elsewhere, every sample arrives once,
    and the tokens equal a run without the failure (the seed fixes them)."""
    c = Cluster(model_dir=model_dir, redis_url=redis_url, num_workers=2, chunk_tokens=4).start()
    try:
        params = SamplingParams(temperature=1.0, max_tokens=60, seed=11, ignore_eos=True)
        with RolloutClient(c.address, timeout_s=120) as client:
            reference = client.rollout("ref", prompts(3, offset=300), n=4, sampling=params)
            got = []
            t = threading.Thread(target=lambda: got.extend(
                client.submit_step("crash", prompts(3, offset=300), n=4, sampling=params)))
            t.start()
            time.sleep(0.5)
            c.kill_worker("w1")
            t.join(120)
        assert sorted(s.key for s in got) == sorted(s.key for s in reference.samples)
        assert {s.key: s.token_ids for s in got} == {s.key: s.token_ids for s in reference.samples}
    finally:
        c.stop()


def test_sdk_retries_after_deadline_join_the_same_step(cluster):
    """Deadlines shorter than the step: each retry re-joins the step by its id, so the
    trainer gets every sample once and the service generates them once."""
    params = SamplingParams(temperature=1.0, max_tokens=120, seed=21, ignore_eos=True)
    before = cluster.scheduler.dispatcher.num_generated_tokens
    with RolloutClient(cluster.address, timeout_s=0.4, max_retries=200) as impatient:
        got = list(impatient.submit_step("retried", prompts(3, offset=400), n=4, sampling=params))
    assert sorted(s.key for s in got) == sorted((f"p{400 + i}", k) for i in range(3) for k in range(4))
    assert cluster.scheduler.dispatcher.num_generated_tokens - before == sum(len(s.token_ids) for s in got)


def test_async_client_streams_and_reports(cluster):
    import asyncio

    from rhymerl import AsyncRolloutClient

    async def main():
        async with AsyncRolloutClient(cluster.address, timeout_s=60) as client:
            seen = [s async for s in client.submit_step("async", prompts(2, offset=500), n=2, sampling=GREEDY)]
            stats = await client.stats()
            return seen, client.last_summary, stats

    seen, summary, stats = asyncio.run(main())
    assert len(seen) == 4 and summary.num_samples == 4
    assert len(stats.workers) == 2 and all(w.healthy for w in stats.workers)


def test_a_request_that_fails_every_worker_is_given_up_not_retried_forever(model_dir, redis_url):
    """An engine that raises whenever one prompt is in its batch (a poison request): the
    step still ends; that prompt's samples come back as aborts naming the error after
    max_attempts tries, and the workers stay healthy and serve the next step."""
    c = Cluster(model_dir=model_dir, redis_url=redis_url, num_workers=2, chunk_tokens=0).start()
    poison = Prompt("poison", [5, 6, 7, 8])
    try:
        for server, _ in c.workers.values():
            engine = server.servicer.engine
            real_step = engine.step

            def step(engine=engine, real_step=real_step):
                if any(s.req.prompt_id == "poison" for s in engine.seqs.values()):
                    raise RuntimeError("injected engine failure")
                return real_step()
            engine.step = step
        with RolloutClient(c.address, timeout_s=120) as client:
            result = client.rollout("poisoned", [poison], n=2, sampling=GREEDY)
            assert sorted(s.key for s in result.samples) == [("poison", 0), ("poison", 1)]
            for s in result.samples:
                assert s.finish_reason == "abort"
                assert "INTERNAL" in s.error and "injected engine failure" in s.error
            healthy = client.rollout("after", prompts(2, offset=700), n=2, sampling=GREEDY)
        assert all(s.finish_reason in ("stop", "length") and not s.error for s in healthy.samples)
        assert len(c.scheduler.dispatcher.workers.usable()) == 2
    finally:
        c.stop()


@pytest.mark.parametrize("policy", ["static", "seer", "histopipe", "rhymerl"])
def test_every_placement_policy_serves_the_same_samples(model_dir, redis_url, policy):
    """Placement changes where and in what order samples run, never what they are: the
    same seeded step gives the same tokens under every policy, over two epochs (the
    second one with history-based length predictions and drafts)."""
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=5)
    c = Cluster(model_dir=model_dir, redis_url=redis_url, num_workers=2, policy=policy, chunk_tokens=8).start()
    try:
        with RolloutClient(c.address, timeout_s=120) as client:
            epochs = [client.rollout(f"{policy}-e{e}", prompts(3, offset=800), n=3, sampling=params)
                      for e in range(2)]
    finally:
        c.stop()
    got = [{s.key: s.token_ids for s in r.samples} for r in epochs]
    assert got[0] == got[1]  # same seed, same policy version: same samples
    assert epochs[1].summary.policy == policy
    assert epochs[1].summary.history_hit_rate == 1.0
    key = ("policy-samples", tuple(sorted(got[0].items())))
    _SAMPLES_BY_POLICY.setdefault(key[0], key[1])
    assert _SAMPLES_BY_POLICY[key[0]] == key[1]


_SAMPLES_BY_POLICY: dict = {}
