"""The rollout path end to end: SDK -> scheduler -> workers -> history, over real gRPC and Redis."""

from __future__ import annotations

import hashlib
import threading

import grpc
import pytest
from rhymerl import Prompt, RolloutClient, SamplingParams
from rhymerl.v1 import common_pb2, rollout_pb2_grpc

from tests.e2e.cluster import TINY, Cluster, expect_status, prompts

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def client(cluster):
    with RolloutClient(cluster.address, timeout_s=120, max_retries=2) as c:
        yield c


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
    generated = cluster.scheduler.core.num_generated_tokens
    again = client.rollout("idem", prompts(2), n=2, sampling=SAMPLED)
    assert {s.key: s.token_ids for s in again.samples} == {s.key: s.token_ids for s in first.samples}
    assert cluster.scheduler.core.num_generated_tokens == generated


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
    # The workers size drafts by the fixed H100 table (measure_cost=False), not by this
    # machine's speed: epoch 2 drafts, and a draft from an exact greedy history is accepted.
    assert second.summary.num_draft_tokens > 0
    assert second.summary.num_accepted_tokens >= 0.9 * second.summary.num_draft_tokens
    assert second.summary.num_accepted_tokens > 2 * first.summary.num_accepted_tokens


def test_rewards_are_recorded(client):
    client.rollout("rewarded", prompts(1), n=2, sampling=GREEDY)
    assert client.report_rewards("rewarded", [("p0", 0, 1.0), ("p0", 1, 0.0)]) == 2
    with pytest.raises(grpc.RpcError) as err:
        client.report_rewards("rewarded", [("p0", 5, 1.0)])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and "rewards[0]" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # which one would count?
        client.report_rewards("rewarded", [("p0", 0, 1.0), ("p0", 0, 0.5)])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("rewards[1]")


def test_a_reward_for_a_sample_still_running_is_refused_and_nothing_is_stored(client, cluster):
    """As ReportLogprobs answers: a reward is of a finished sample (one then cancelled
    would have left its reward in history with no sample beside it)."""
    long = SamplingParams(temperature=1.0, max_tokens=400, seed=5, ignore_eos=True)
    got = []
    t = threading.Thread(target=lambda: got.extend(client.submit_step("reward-early", prompts(2, offset=240), n=2,
                                                                      sampling=long)))
    t.start()
    cluster.wait_running("reward-early")
    try:
        with pytest.raises(grpc.RpcError) as err:
            client.report_rewards("reward-early", [("p240", 0, 1.0)])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, err.value.details()
        assert err.value.details().startswith("rewards[0]") and "has not finished" in err.value.details()
    finally:
        client.cancel_step("reward-early")
        t.join(60)


def test_cancel_aborts_unfinished_samples(client, cluster):
    long = SamplingParams(temperature=1.0, max_tokens=400, seed=5, ignore_eos=True)
    got = []

    def run():
        got.extend(client.submit_step("cancel-me", prompts(4, offset=200), n=8, sampling=long))

    t = threading.Thread(target=run)
    t.start()
    cluster.wait_running("cancel-me")  # not a sleep: a busy machine may take longer to start it
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
            c.wait_running("crash", "w1")  # killed with work on it, however slow the machine
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
    before = cluster.scheduler.core.num_generated_tokens
    with RolloutClient(cluster.address, timeout_s=0.4, max_retries=200) as impatient:
        got = list(impatient.submit_step("retried", prompts(3, offset=400), n=4, sampling=params))
    assert sorted(s.key for s in got) == sorted((f"p{400 + i}", k) for i in range(3) for k in range(4))
    assert cluster.scheduler.core.num_generated_tokens - before == sum(len(s.token_ids) for s in got)


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
    max_attempts tries; the samples that shared its batches come back exactly as in a
    clean run; the workers stay healthy and serve the next step."""
    c = Cluster(model_dir=model_dir, redis_url=redis_url, num_workers=2, chunk_tokens=0).start()
    poison = Prompt("poison", [5, 6, 7, 8])
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=4)
    try:
        with RolloutClient(c.address, timeout_s=120) as client:
            clean = client.rollout("clean", prompts(3, offset=650), n=2, sampling=params)
            for server, _ in c.workers.values():
                engine = server.servicer.engine
                real_step = engine.step

                def step(engine=engine, real_step=real_step):
                    if any(s.req.prompt_id == "poison" for s in engine.seqs.values()):
                        raise RuntimeError("injected engine failure")
                    return real_step()
                engine.step = step
            result = client.rollout("poisoned", [poison, *prompts(3, offset=650)], n=2, sampling=params)
            healthy = client.rollout("after", prompts(2, offset=700), n=2, sampling=GREEDY)
        by_key = {s.key: s for s in result.samples}
        assert sorted(by_key) == sorted([("poison", 0), ("poison", 1)] + [s.key for s in clean.samples])
        for k in range(2):
            assert by_key["poison", k].finish_reason == "abort"
            assert "RuntimeError: injected engine failure" in by_key["poison", k].error
        for s in clean.samples:
            assert by_key[s.key].token_ids == s.token_ids and not by_key[s.key].error
        assert all(s.finish_reason in ("stop", "length") and not s.error for s in healthy.samples)
        assert len(c.scheduler.core.workers.usable()) == 2
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


# --- Bad input: every case of the contract, each with its status code and the field it names,
# sent while a good step runs; the good step loses nothing.

from rhymerl.v1 import rollout_pb2  # noqa: E402

from services.common.validation import MAX_N, MAX_STOP_TOKEN_IDS  # noqa: E402


def _oversized_submit(address: str) -> grpc.RpcError:
    """A SubmitStep one byte over the server's message limit, sent raw (the SDK's own send
    limit would stop it client-side): the server answers RESOURCE_EXHAUSTED."""
    from services.common.grpc_server import MAX_MESSAGE_BYTES

    size = MAX_MESSAGE_BYTES + 1
    varint, v = bytearray(), size
    while v >= 0x80:
        varint.append(v & 0x7F | 0x80)
        v >>= 7
    varint.append(v)
    payload = b"\x0a" + bytes(varint) + b"x" * size  # field 1 (step_id), length-delimited
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_stream("/rhymerl.v1.RolloutService/SubmitStep",
                                    response_deserializer=rollout_pb2.StepEvent.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(payload, timeout=60))
    return err.value


def _long_prompt(length: int) -> list[Prompt]:
    return [Prompt("long", [2 + j % 90 for j in range(length)])]


# (case, change to a good SubmitStep, expected status, field the message starts with)
BAD_SUBMITS = [
    ("empty prompt", dict(prompts=[Prompt("empty", [])]), "INVALID_ARGUMENT", "prompts[0].token_ids"),
    ("no prompts", dict(prompts=[]), "INVALID_ARGUMENT", "prompts"),
    ("token id >= vocab", dict(prompts=[Prompt("big-id", [5, TINY["vocab_size"]])]), "INVALID_ARGUMENT",
     "prompts[0].token_ids"),
    ("negative token id", dict(prompts=[Prompt("neg-id", [5, -1])]), "INVALID_ARGUMENT", "prompts[0].token_ids"),
    ("n = 0", dict(n=0), "INVALID_ARGUMENT", "n"),
    ("n negative", dict(n=-3), "INVALID_ARGUMENT", "n"),
    ("n huge", dict(n=2**31 - 1), "INVALID_ARGUMENT", "n"),
    ("n just over the limit", dict(n=MAX_N + 1), "INVALID_ARGUMENT", "n"),
    ("n x prompts over the queue limit", dict(n=MAX_N, prompts=prompts(300, length=2)), "RESOURCE_EXHAUSTED",
     "prompts"),
    ("max_tokens = 0", dict(sampling=SamplingParams(max_tokens=0)), "INVALID_ARGUMENT", "sampling.max_tokens"),
    ("max_tokens negative", dict(sampling=SamplingParams(max_tokens=-1)), "INVALID_ARGUMENT",
     "sampling.max_tokens"),
    ("prompt + max_tokens one past the context",
     dict(sampling=SamplingParams(max_tokens=TINY["max_position_embeddings"] - 6 + 1)), "INVALID_ARGUMENT",
     "sampling.max_tokens"),
    ("max_tokens huge", dict(sampling=SamplingParams(max_tokens=2**31 - 1)), "INVALID_ARGUMENT",
     "sampling.max_tokens"),
    ("prompt as long as the context", dict(prompts=_long_prompt(TINY["max_position_embeddings"]),
                                            sampling=SamplingParams(max_tokens=1)), "INVALID_ARGUMENT",
     "prompts[0].token_ids"),
    ("temperature < 0", dict(sampling=SamplingParams(temperature=-0.01)), "INVALID_ARGUMENT",
     "sampling.temperature"),
    ("temperature nan", dict(sampling=SamplingParams(temperature=float("nan"))), "INVALID_ARGUMENT",
     "sampling.temperature"),
    ("temperature inf", dict(sampling=SamplingParams(temperature=float("inf"))), "INVALID_ARGUMENT",
     "sampling.temperature"),
    ("top_p > 1", dict(sampling=SamplingParams(top_p=1.0001)), "INVALID_ARGUMENT", "sampling.top_p"),
    ("top_p < 0", dict(sampling=SamplingParams(top_p=-0.5)), "INVALID_ARGUMENT", "sampling.top_p"),
    ("top_p nan", dict(sampling=SamplingParams(top_p=float("nan"))), "INVALID_ARGUMENT", "sampling.top_p"),
    ("top_k < 0", dict(sampling=SamplingParams(top_k=-1)), "INVALID_ARGUMENT", "sampling.top_k"),
    ("stop token >= vocab", dict(sampling=SamplingParams(stop_token_ids=(TINY["vocab_size"],))),
     "INVALID_ARGUMENT", "sampling.stop_token_ids"),
    ("stop tokens over the limit", dict(sampling=SamplingParams(stop_token_ids=(3,) * (MAX_STOP_TOKEN_IDS + 1))),
     "INVALID_ARGUMENT", "sampling.stop_token_ids"),
    ("policy version not pushed", dict(policy_version=10**6), "FAILED_PRECONDITION", "policy_version"),
]


@pytest.mark.parametrize("case, change, code, field", BAD_SUBMITS, ids=[c[0] for c in BAD_SUBMITS])
def test_each_bad_submit_gets_its_status_code_naming_the_field(cluster, case, change, code, field):
    """Each bad input of the contract: its own status code, the message starts with the field,
    and the step is not created (a later good submit with the same id is a new step)."""
    step_id = f"bad/{case}"
    args = dict(step_id=step_id, prompts=prompts(1), n=1, sampling=GREEDY)
    args.update(change)
    with RolloutClient(cluster.address, timeout_s=60, max_retries=0) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.rollout(**args)
        expect_status(err.value, code, field)
        assert step_id not in cluster.scheduler.core.steps


def test_cancel_of_an_unknown_step_is_not_found_naming_the_step_id(client, cluster):
    with pytest.raises(grpc.RpcError) as err:
        client.cancel_step("never-submitted")
    expect_status(err.value, "NOT_FOUND", "step_id")
    with pytest.raises(grpc.RpcError) as err:
        client.cancel_step("")
    expect_status(err.value, "INVALID_ARGUMENT", "step_id")
    assert "never-submitted" not in cluster.scheduler.core.steps


def test_oversized_message_is_resource_exhausted_and_the_service_keeps_serving(client, cluster):
    steps = len(cluster.scheduler.core.steps)
    err = _oversized_submit(cluster.address)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
    assert "larger than max" in err.details()
    assert len(cluster.scheduler.core.steps) == steps
    result = client.rollout("after-oversized", prompts(1), n=1, sampling=GREEDY)
    assert len(result.samples) == 1


def test_every_bad_input_while_a_step_runs_loses_nothing_in_flight(client, cluster):
    """A good step runs while every bad input of the contract arrives (bad submits, cancel of
    an unknown step, an oversized message): each bad call fails with its own code, and the
    good step, verifiably still running throughout, returns every sample whole, with the
    tokens its seed fixes."""
    params = SamplingParams(temperature=1.0, max_tokens=400, seed=17, ignore_eos=True)
    good = prompts(2, offset=900)
    got, errors = [], []

    def run():
        try:
            got.extend(client.submit_step("in-flight", good, n=6, sampling=params))
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    cluster.wait_running("in-flight")
    run_ = cluster.scheduler.core.steps.get("in-flight")
    with RolloutClient(cluster.address, timeout_s=60, max_retries=0) as other:
        for case, change, code, field in BAD_SUBMITS:
            args = dict(step_id=f"bad-in-flight/{case}", prompts=prompts(1), n=1, sampling=GREEDY)
            args.update(change)
            with pytest.raises(grpc.RpcError) as err:
                other.rollout(**args)
            expect_status(err.value, code, field)
        with pytest.raises(grpc.RpcError) as err:
            other.cancel_step("no-such-step")
        expect_status(err.value, "NOT_FOUND", "step_id")
        assert _oversized_submit(cluster.address).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not run_.is_finished, "the good step ended before the bad inputs: the test proves nothing"
    t.join(300)
    assert not t.is_alive() and not errors, errors
    assert sorted(s.key for s in got) == sorted((p.prompt_id, k) for p in good for k in range(6))
    for s in got:
        assert s.finish_reason == "length" and not s.error, (s.key, s.finish_reason, s.error)
        assert len(s.token_ids) == len(s.logprobs) == 400
    # The seed fixes the tokens: a quiet rerun of the same step content gives the same samples.
    quiet = client.rollout("in-flight-quiet", good, n=6, sampling=params)
    assert {s.key: s.token_ids for s in quiet.samples} == {s.key: s.token_ids for s in got}


def test_sdk_retries_only_what_a_resend_can_fix():
    """UNAVAILABLE and DEADLINE_EXCEEDED are retried (step ids make it safe); RESOURCE_EXHAUSTED
    never: a request over a limit (samples in flight, message size) does not fit on a
    re-send, and retrying adds load to a full service. The details are the ones the real
    server sends."""
    from rhymerl import _calls

    class Status(grpc.RpcError):
        def __init__(self, code, details):
            self._code, self._details = code, details

        def code(self):
            return self._code

        def details(self):
            return self._details

    too_large = "Received message larger than max (268435457 vs. 268435456)"
    busy = "prompts: 800 samples would exceed the limit of samples in flight (262000 of 262144 used)"
    assert not _calls.is_retryable(Status(grpc.StatusCode.RESOURCE_EXHAUSTED, too_large))
    assert not _calls.is_retryable(Status(grpc.StatusCode.RESOURCE_EXHAUSTED, busy))
    assert _calls.is_retryable(Status(grpc.StatusCode.UNAVAILABLE, ""))
    assert _calls.is_retryable(Status(grpc.StatusCode.DEADLINE_EXCEEDED, ""))
    assert not _calls.is_retryable(Status(grpc.StatusCode.INVALID_ARGUMENT, "n: must be >= 1"))


def test_sdk_retries_for_its_window_and_a_stream_with_new_samples_starts_a_new_one(monkeypatch):
    """The retry policy on a clock of its own: re-sends while the failures in a row have
    lasted less than the window (not a count: 3 re-sends gave up within 1.4 s, before a
    restarted scheduler was back), at most max_retries in a row when given, never past a
    call's deadline; a new sample starts a new run of failures."""
    from rhymerl import _calls

    class Status(grpc.RpcError):
        def __init__(self, code):
            self._code = code

        def code(self):
            return self._code

        def details(self):
            return "connection refused"

    now = [100.0]
    monkeypatch.setattr(_calls.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(_calls.random, "uniform", lambda lo, hi: hi)  # the longest backoff
    down = Status(grpc.StatusCode.UNAVAILABLE)

    def resends(retry) -> list[float]:
        pauses = []
        while (pause := retry.pause(down, "test")) is not None:
            pauses.append(pause)
            now[0] += pause
        return pauses

    pauses = resends(_calls.Retry(None, 120.0))
    assert pauses[:6] == [0.2, 0.4, 0.8, 1.6, 3.2, 5.0] and set(pauses[6:]) == {5.0}
    assert 115.0 <= sum(pauses) <= 120.0  # the window, whatever the count
    assert resends(_calls.Retry(3, 120.0)) == [0.2, 0.4, 0.8]
    assert resends(_calls.Retry(0, 120.0)) == []
    assert sum(resends(_calls.Retry(None, 120.0, deadline=now[0] + 10.0))) < 10.0
    assert _calls.Retry(None, 120.0).pause(Status(grpc.StatusCode.INVALID_ARGUMENT), "test") is None

    retry = _calls.Retry(None, 10.0)
    assert sum(resends(retry)) <= 10.0
    retry.progressed()  # the stream delivered a new sample: its next failure has the window again
    assert resends(retry)[:2] == [0.2, 0.4]
