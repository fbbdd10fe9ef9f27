"""Input a real RL run sends by mistake or by malice, over real gRPC: ids that collide
when joined, sizes no one bounded, rewards that are not numbers, bytes that are not
UTF-8. Each gets its status naming the field; nothing else is disturbed."""

from __future__ import annotations

import threading

import grpc
import pytest
import redis
from rhymerl import Prompt, RolloutClient, SamplingParams
from rhymerl.v1 import rollout_pb2

from tests.e2e.cluster import expect_status, prompts

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, seed=1)


@pytest.fixture
def client(cluster):
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as c:
        yield c


def test_ids_that_collide_when_joined_are_different_requests(client, cluster):
    """Step "X/a" with prompt "b" and step "X" with prompt "a/b", together: a joined
    "step/prompt/sample" id is the same for both; each step must still get its own
    samples, once, without errors, and leave no sample running anywhere."""
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=3, ignore_eos=True)
    tokens = prompts(1)[0].token_ids
    results, errors = {}, []

    def run(step_id, prompt_id):
        try:
            with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as c:
                results[step_id] = c.rollout(step_id, [Prompt(prompt_id, tokens)], n=3, sampling=params)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=a) for a in (("X/a", "b"), ("X", "a/b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(200)
    assert not errors, errors
    assert sorted(s.key for s in results["X/a"].samples) == [("b", k) for k in range(3)]
    assert sorted(s.key for s in results["X"].samples) == [("a/b", k) for k in range(3)]
    for r in results.values():
        assert all(s.finish_reason == "length" and len(s.token_ids) == 40 and not s.error for s in r.samples)
    stats = client.stats()
    assert all(w.num_running == 0 for w in stats.workers)


@pytest.mark.parametrize("field, change", [
    ("step_id", dict(step_id="s" * 3_000_000)),
    ("step_id", dict(step_id="s" * 257)),
    ("prompts[0].prompt_id", dict(prompts=[Prompt("p" * 100_000, [3, 4])])),
])
def test_oversized_ids_are_invalid_argument(client, cluster, field, change):
    """A step id or prompt id of megabytes would be copied into every sample, the
    history and Redis: ids are bounded and the bound names the field."""
    args = dict(step_id="ok-id", prompts=prompts(1), n=1, sampling=GREEDY)
    args.update(change)
    with pytest.raises(grpc.RpcError) as err:
        client.rollout(**args)
    expect_status(err.value, grpc.StatusCode.INVALID_ARGUMENT, field)
    assert not cluster.scheduler.core.steps.get(args["step_id"])


def test_too_many_stop_tokens_are_invalid_argument_and_the_step_is_not_run(client, cluster):
    """Stop tokens travel in every work item of the step: millions of them made every batch
    to a worker larger than gRPC's message limit, and the step re-queued forever (the worker
    marked lost each time). They are bounded, the bound naming the field; a step at the
    bound runs."""
    from services.common.validation import MAX_STOP_TOKEN_IDS

    too_many = SamplingParams(temperature=1.0, max_tokens=4, stop_token_ids=(50,) * (MAX_STOP_TOKEN_IDS + 1))
    with pytest.raises(grpc.RpcError) as err:
        client.rollout("many-stops", prompts(1), n=2, sampling=too_many)
    expect_status(err.value, grpc.StatusCode.INVALID_ARGUMENT, "sampling.stop_token_ids")
    assert not cluster.scheduler.core.steps.get("many-stops")
    at_bound = SamplingParams(temperature=1.0, max_tokens=4, stop_token_ids=(50,) * MAX_STOP_TOKEN_IDS)
    assert len(client.rollout("bound-stops", prompts(1), n=2, sampling=at_bound).samples) == 2


def test_negative_policy_version_is_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as err:
        client.rollout("neg-version", prompts(1), n=1, sampling=GREEDY, policy_version=-1)
    expect_status(err.value, grpc.StatusCode.INVALID_ARGUMENT, "policy_version")


def test_non_utf8_step_id_is_invalid_argument_naming_it(cluster):
    """Bytes that are not UTF-8 in a string field: INVALID_ARGUMENT naming the field,
    not UNKNOWN with a parser's exception."""
    payload = rollout_pb2.SubmitStepRequest(n=1).SerializeToString() + b"\x0a\x02\xff\xfe"
    with grpc.insecure_channel(cluster.address) as channel:
        call = channel.unary_stream("/rhymerl.v1.RolloutService/SubmitStep",
                                    response_deserializer=rollout_pb2.StepEvent.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(call(payload, timeout=30))
        expect_status(err.value, grpc.StatusCode.INVALID_ARGUMENT, "step_id")
        cancel = channel.unary_unary("/rhymerl.v1.RolloutService/ReportRewards",
                                     response_deserializer=rollout_pb2.ReportRewardsResponse.FromString)
        bad_reward = b"\x0a\x01s" + b"\x12\x04" + b"\x0a\x02\xc3\x28"  # rewards[0].prompt_id = C3 28
        with pytest.raises(grpc.RpcError) as err:
            cancel(bad_reward, timeout=30)
        expect_status(err.value, grpc.StatusCode.INVALID_ARGUMENT, "rewards[0].prompt_id")


def test_rewards_are_checked_before_anything_is_stored(client, cluster, redis_url):
    """A negative sample index, an unknown step, NaN or Inf: each a clear status naming
    the field, and nothing written to history (NaN is its "no reward" marker)."""
    client.rollout("rewards", prompts(1), n=2, sampling=GREEDY)
    keys_before = set(redis.Redis.from_url(redis_url).keys("*"))
    cases = [
        ("rewards", [("p0", -1, 1.0)], grpc.StatusCode.INVALID_ARGUMENT, "rewards[0].sample_index"),
        ("rewards", [("p0", 0, 1.0), ("p0", 1, float("nan"))], grpc.StatusCode.INVALID_ARGUMENT,
         "rewards[1].reward"),
        ("rewards", [("p0", 0, float("inf"))], grpc.StatusCode.INVALID_ARGUMENT, "rewards[0].reward"),
        ("rewards", [("p0", 0, float("-inf"))], grpc.StatusCode.INVALID_ARGUMENT, "rewards[0].reward"),
        ("never-submitted", [("p0", 0, 1.0)], grpc.StatusCode.NOT_FOUND, "step_id"),
        ("", [("p0", 0, 1.0)], grpc.StatusCode.INVALID_ARGUMENT, "step_id"),
    ]
    for step_id, rewards, code, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            client.report_rewards(step_id, rewards)
        expect_status(err.value, code, field)
    assert set(redis.Redis.from_url(redis_url).keys("*")) == keys_before
    assert client.report_rewards("rewards", [("p0", 0, 1.0), ("p0", 1, -0.5)]) == 2


def test_a_reward_report_is_bounded_by_its_steps_size_before_any_reward_is_looked_at(client, cluster,
                                                                                      monkeypatch):
    """The rewards of a report were each checked before its step was even looked up: a
    report as long as the message limit allows (10 M rewards in 256 MB, for a step that
    may not exist) held the scheduler's event loop for tens of seconds (2 M: 3.8 s on
    this machine's CPU). Now the step comes first (NOT_FOUND), and a report with more
    rewards than the step has samples is INVALID_ARGUMENT naming ``rewards`` before any
    reward is looked at."""
    from services.scheduler import intake

    client.rollout("bounded-rewards", prompts(1), n=2, sampling=GREEDY)
    looked_at = []
    check = intake.check_rewards
    monkeypatch.setattr(intake, "check_rewards", lambda req: (looked_at.append(len(req.rewards)), check(req)))
    with pytest.raises(grpc.RpcError) as err:  # 3 rewards for 2 samples (p0's third does not exist)
        client.report_rewards("bounded-rewards", [("p0", 0, 1.0), ("p0", 1, 1.0), ("p0", 2, 1.0)])
    expect_status(err.value, "INVALID_ARGUMENT", "rewards")
    assert "3 rewards for a step of 2 samples" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # an unknown step: its rewards are not looked at
        client.report_rewards("never-submitted", [("p0", k, float("nan")) for k in range(1000)])
    expect_status(err.value, "NOT_FOUND", "step_id")
    assert looked_at == []
    assert client.report_rewards("bounded-rewards", [("p0", 0, 1.0), ("p0", 1, -0.5)]) == 2
    assert looked_at == [2]


def test_sdk_does_not_retry_resource_exhausted(cluster):
    """RESOURCE_EXHAUSTED means "over a limit": re-sending the same request cannot fit
    it, and three retries triple the load on a service that is already full."""
    calls = []

    class Counting(grpc.UnaryStreamClientInterceptor):
        def intercept_unary_stream(self, continuation, details, request):
            calls.append(details.method)
            return continuation(details, request)

    with RolloutClient(cluster.address, timeout_s=60, max_retries=3) as c:
        c._stub = type(c._stub)(grpc.intercept_channel(c._channel, Counting()))
        with pytest.raises(grpc.RpcError) as err:
            c.rollout("too-many", prompts(300, length=2), n=4096, sampling=GREEDY)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(calls) == 1


def test_a_small_step_beside_a_huge_one_gets_its_share_and_health_answers(cluster):
    """A valid 16 x 4096-sample step must not starve another trainer's small step, and
    the scheduler's health check keeps answering while it is admitted and runs. Counted in
    the scheduler's dispatch order, not in time: once the small step is submitted, each of
    its samples starts before the huge one gets another fleet's worth of chunks (a hang
    guard bounds the wait; no speed is assumed)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    big_params = SamplingParams(temperature=1.0, max_tokens=64, seed=5, ignore_eos=True)
    big_done, health_errors, stop = [], [], threading.Event()

    def big():
        with RolloutClient(cluster.address, timeout_s=600, max_retries=0) as c:
            big_done.extend(c.submit_step("huge", prompts(16, offset=500), n=4096, sampling=big_params))

    def probe():
        with grpc.insecure_channel(cluster.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not stop.is_set():
                try:
                    stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)  # a hang guard
                except grpc.RpcError as err:  # noqa: PERF203 - every miss is reported
                    health_errors.append(err.code())
                stop.wait(0.1)

    core, order = cluster.scheduler.core, []  # ("submit", step id) and each chunk's RequestKey, in order
    start, submit = core.runs.start, core.submit

    def logged_start(worker, assignments, now):
        order.extend(a.request.key for a in assignments)
        return start(worker, assignments, now)

    async def logged_submit(req):
        order.append(("submit", req.step_id))
        return await submit(req)

    core.runs.start, core.submit = logged_start, logged_submit
    threads = [threading.Thread(target=big, daemon=True), threading.Thread(target=probe, daemon=True)]
    for t in threads:
        t.start()
    cluster.wait_running("huge")
    with RolloutClient(cluster.address, timeout_s=240, max_retries=0) as c:
        small = c.rollout("small", prompts(2, offset=900), n=2, sampling=GREEDY)
        assert len(small.samples) == 4 and all(s.finish_reason != "abort" for s in small.samples)
        after = order[order.index(("submit", "small")) + 1:]
        firsts = [i for i, key in enumerate(after) if key[0] == "small" and key not in after[:i]]
        fleet = sum(w.state.capacity for w in core.workers.workers.values())
        assert len(firsts) == 4
        assert sum(key[0] == "huge" for key in after[:firsts[-1]]) < fleet, "the small step waited for the huge one"
        assert c.cancel_step("huge") > 0
    threads[0].join(300)
    stop.set()
    threads[1].join(30)
    assert not health_errors, health_errors
    assert len(big_done) == 16 * 4096
