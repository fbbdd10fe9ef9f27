"""Weight pushes at every moment of a step, over real gRPC with chunked (divided) rollout:
during a step, failing, cancelled, carrying NaN, repeated. Dispatch never stops for
good, and a push that does not complete leaves the old version serving."""

from __future__ import annotations

import hashlib
import threading
import time

import grpc
import pytest
import torch
from rhymerl import RolloutClient, SamplingParams
from rhymerl.v1 import common_pb2, rollout_pb2_grpc

from tests.e2e.cluster import TINY, Cluster, prompts

pytestmark = pytest.mark.timeout(300)
LONG = SamplingParams(temperature=1.0, max_tokens=160, seed=9, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, seed=1)


def weights(seed: int = 1, poison: float | None = None) -> bytes:
    from safetensors.torch import save

    from services.rollout.loader import init_random_model
    from services.rollout.models.config import ModelConfig

    state = {k: v.contiguous() for k, v in init_random_model(ModelConfig(**TINY), seed=seed).state_dict().items()}
    if poison is not None:
        name = sorted(state)[len(state) // 2]
        state[name].view(-1)[3] = poison
    return save(state)


class Step(threading.Thread):
    """Runs one step in the background and keeps what came back."""

    def __init__(self, address: str, step_id: str, sampling: SamplingParams = LONG, k: int = 3, n: int = 4):
        super().__init__(daemon=True)
        self.address, self.step_id, self.sampling, self.k, self.n = address, step_id, sampling, k, n
        self.samples, self.error = [], None

    def run(self):
        try:
            with RolloutClient(self.address, timeout_s=200, max_retries=0) as c:
                self.samples = c.rollout(self.step_id, prompts(self.k, offset=40), n=self.n,
                                         sampling=self.sampling).samples
        except Exception as exc:  # noqa: BLE001 - checked by the test
            self.error = exc

    def wait_running(self, cluster: Cluster) -> None:
        cluster.wait_running(self.step_id)


@pytest.fixture
def cluster(model_dir, redis_url, request):
    settings = getattr(request, "param", {})
    c = Cluster(model_dir=model_dir, redis_url=redis_url, chunk_tokens=8, scheduler_settings=settings).start()
    yield c
    c.stop()


def test_a_push_during_a_step_waits_for_it_while_dispatch_goes_on(cluster):
    """Synchronous mode: the step that runs when the push arrives finishes on the old
    version (chunked rollout keeps dispatching its chunks); the push then applies, and
    the next step samples the new version."""
    step = Step(cluster.address, "during-push")
    step.start()
    step.wait_running(cluster)
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.push_weights(1, weights()) == 1
        step.join(200)
        assert step.error is None and len(step.samples) == 12
        assert all(s.policy_version == 0 and not s.token_policy_versions for s in step.samples)
        assert all(len(s.token_ids) == 160 for s in step.samples)
        after = client.rollout("after-push", prompts(2), n=2, sampling=GREEDY)
        assert all(s.policy_version == 1 for s in after.samples)


@pytest.mark.parametrize("cluster", [dict(weight_updates="between_chunks")], indirect=True)
def test_bounded_staleness_applies_a_push_between_chunks(cluster):
    """Bounded-staleness mode: the push waits only for the chunks in flight; samples
    that span it say so token by token (old version first, then the new one)."""
    step = Step(cluster.address, "stale", SamplingParams(**{**LONG.__dict__, "max_tokens": 400}), k=4)
    step.start()
    step.wait_running(cluster)
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.push_weights(1, weights()) == 1
        assert step.is_alive(), "the push waited for the whole step"
    step.join(250)
    assert step.error is None and len(step.samples) == 16
    spanning = [s for s in step.samples if s.token_policy_versions]
    assert spanning, "no sample spans the push"
    for s in spanning:
        versions = s.token_policy_versions
        assert len(versions) == len(s.token_ids) and versions == sorted(versions) and set(versions) == {0, 1}
        assert s.policy_version == 0


def test_failed_and_cancelled_pushes_leave_dispatch_running_and_the_old_version(cluster):
    step = Step(cluster.address, "survives-pushes")
    step.start()
    step.wait_running(cluster)
    data = weights()
    with grpc.insecure_channel(cluster.address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        header = common_pb2.WeightChunk(header=common_pb2.WeightHeader(
            version=1, total_bytes=len(data), sha256=hashlib.sha256(b"other").hexdigest()))
        with pytest.raises(grpc.RpcError) as err:
            stub.PushWeights(iter([header, common_pb2.WeightChunk(data=data)]), timeout=120)
        assert err.value.code() == grpc.StatusCode.DATA_LOSS

        def trickle():  # a trainer that dies after the header
            yield common_pb2.WeightChunk(header=common_pb2.WeightHeader(
                version=1, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
            time.sleep(0.5)
            yield common_pb2.WeightChunk(data=data[:100])
            time.sleep(300)
        call = stub.PushWeights.future(trickle(), timeout=120)
        time.sleep(1.0)
        call.cancel()
        with pytest.raises(grpc.RpcError):  # a trainer whose deadline is shorter than the step
            stub.PushWeights(iter([header]), timeout=0.5)
    step.join(200)
    assert step.error is None and len(step.samples) == 12
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.stats().policy_version == 0
        after = client.rollout("after-failed-pushes", prompts(2), n=2, sampling=GREEDY)
        assert all(s.policy_version == 0 for s in after.samples)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused_and_the_old_version_serves(cluster, poison):
    """NaN or Inf in any tensor would make every later sample token 0 with NaN logprobs."""
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        before = client.rollout("finite-before", prompts(2), n=2, sampling=GREEDY)
        with pytest.raises(grpc.RpcError) as err:
            client.push_weights(1, weights(poison=poison))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not finite" in err.value.details() and err.value.details().startswith("data:")
        assert client.stats().policy_version == 0
        again = client.rollout("finite-after", prompts(2), n=2, sampling=GREEDY)
        assert {s.key: s.token_ids for s in again.samples} == {s.key: s.token_ids for s in before.samples}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_a_tensor_that_is_not_floating_point_is_refused_naming_it_and_the_old_version_serves(cluster, dtype):
    """Copied into a float parameter, an integer tensor's values would be the weights
    truncated to integers: refused (INVALID_ARGUMENT naming the tensor), nothing loaded."""
    from safetensors.torch import load, save

    state = load(weights(seed=2))
    name = sorted(state)[len(state) // 2]
    state[name] = (state[name] * 100).to(dtype)
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        before = client.rollout("dtype-before", prompts(2), n=2, sampling=GREEDY)
        with pytest.raises(grpc.RpcError) as err:
            client.push_weights(1, save(state))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details()
        assert f"{name}: dtype {str(dtype).removeprefix('torch.')}, expected a floating-point one" in details
        assert client.stats().policy_version == 0
        again = client.rollout("dtype-after", prompts(2), n=2, sampling=GREEDY)
        assert {s.key: s.token_ids for s in again.samples} == {s.key: s.token_ids for s in before.samples}
        client.push_weights(1, weights(seed=2))  # the same weights as floats are taken
        assert client.stats().policy_version == 1


def test_re_pushing_the_serving_version_is_acknowledged(cluster):
    """The SDK retries a push after UNAVAILABLE or a deadline: re-sending the version that
    already serves, with the same bytes, must succeed; other bytes under that version
    must not."""
    data = weights()
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.push_weights(1, data) == 1
        assert client.push_weights(1, data) == 1
        with pytest.raises(grpc.RpcError) as err:
            client.push_weights(1, weights(seed=2))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert all(w.policy_version == 1 for w in client.stats().workers)


def test_a_worker_reached_directly_refuses_an_older_or_equal_version_with_other_bytes(cluster, tmp_path):
    """The worker's own check, without the scheduler's in front of it (a tool that reaches
    a worker directly, or a restarted scheduler with stale state): once version 2 serves,
    version 2 with other bytes and version 1 are refused (pushed or loaded from a path),
    the same bytes again are acknowledged, and version 2's weights keep serving."""
    from rhymerl._calls import weight_chunks
    from rhymerl.v1 import worker_pb2, worker_pb2_grpc

    from services.rollout.loader import init_random_model, save_model
    from services.rollout.models.config import ModelConfig

    data = weights(seed=1)
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.push_weights(2, data) == 2
        served = client.rollout("direct-before", prompts(2), n=2, sampling=GREEDY)
    save_model(init_random_model(ModelConfig(**TINY), seed=3), tmp_path / "other")
    address = cluster.scheduler.core.workers.workers["w0"].address
    with grpc.insecure_channel(address) as channel:
        worker = worker_pb2_grpc.WorkerServiceStub(channel)
        for version, payload in ((2, weights(seed=2)), (1, weights(seed=2)), (1, data)):
            with pytest.raises(grpc.RpcError) as err:
                worker.PushWeights(weight_chunks(version, payload), timeout=120)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, version
            assert err.value.details().startswith("version:")
        for version in (1, 2):
            with pytest.raises(grpc.RpcError) as err:
                worker.LoadWeights(common_pb2.LoadWeightsRequest(version=version, path=str(tmp_path / "other")),
                                   timeout=120)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, version
        assert worker.PushWeights(weight_chunks(2, data), timeout=120).version == 2
        assert worker.GetWorkerStats(worker_pb2.WorkerStatsRequest(), timeout=30).policy_version == 2
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        again = client.rollout("direct-after", prompts(2), n=2, sampling=GREEDY)
    assert {s.key: s.token_ids for s in again.samples} == {s.key: s.token_ids for s in served.samples}


def test_re_pushing_the_initial_weights_as_version_0_is_acknowledged(cluster, model_dir):
    """Version 0 is the checkpoint the workers started from, whose bytes the scheduler
    never saw: the workers recognise a re-push of it (one .safetensors file), and refuse
    other bytes under that version."""
    initial = (model_dir / "model.safetensors").read_bytes()
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.stats().policy_version == 0
        with pytest.raises(grpc.RpcError) as err:
            client.push_weights(0, weights(seed=2))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert client.push_weights(0, initial) == 0  # acknowledged (the version serving)
        assert client.push_weights(0, initial) == 0  # and again, known to the scheduler now
        assert all(w.policy_version == 0 for w in client.stats().workers)


def test_a_load_from_a_bad_path_fails_at_once_not_after_the_running_step(cluster, tmp_path):
    """after_steps: a load waits for the running steps before it applies, but a path no
    worker can read is NOT_FOUND at once (the step still runs when the error comes)."""
    step = Step(cluster.address, "bad-path-step")
    step.start()
    step.wait_running(cluster)
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.load_weights(1, str(tmp_path / "no-such-checkpoint"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details().startswith("path:")
        assert step.is_alive(), "the error came only after the step ended"
        (tmp_path / "empty").mkdir()
        with pytest.raises(grpc.RpcError) as err:  # a directory with no .safetensors file
            client.load_weights(1, str(tmp_path / "empty"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert client.stats().policy_version == 0
    step.join(200)
    assert not step.error and len(step.samples) == 12


def test_a_load_from_a_path_the_system_refuses_to_look_at_is_not_found_naming_it(cluster):
    """A path the OS refuses to stat (a name over NAME_MAX, a path over PATH_MAX): the
    worker's OSError was an INTERNAL error (its traceback in the log), which the scheduler
    turned into UNAVAILABLE, a status the SDK retries. Now NOT_FOUND naming the path, on
    the worker and through the scheduler, and nothing is loaded."""
    from rhymerl.v1 import worker_pb2_grpc

    too_long = ["/" + "a" * 300, "/x" * 3000]  # one name over 255 bytes; the whole path over 4096
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        for path in too_long:
            with pytest.raises(grpc.RpcError) as err:
                client.load_weights(1, path)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND, (err.value.code(), err.value.details())
            assert err.value.details().startswith("path:") and "too long" in err.value.details()
            assert len(err.value.details()) < 500  # the path is not echoed whole
        assert client.stats().policy_version == 0
    address = cluster.scheduler.core.workers.workers["w0"].address
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            worker_pb2_grpc.WorkerServiceStub(channel).LoadWeights(
                common_pb2.LoadWeightsRequest(version=1, path=too_long[0]), timeout=60)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND and err.value.details().startswith("path:")


def test_a_push_cancelled_while_the_engine_is_busy_changes_neither_weights_nor_version(cluster):
    """A worker's weights and version change together or not at all. A push whose call is
    cancelled (the scheduler gave up on it, the trainer's deadline) after its payload was
    verified, while the engine is busy, used to leave its load queued: it ran once the
    engine was idle, and the worker served the new weights under the old version."""
    import asyncio

    from prometheus_client import REGISTRY
    from rhymerl._calls import weight_chunks
    from rhymerl.v1 import worker_pb2_grpc

    servicer = cluster.workers["w0"][0].servicer
    address = cluster.scheduler.core.workers.workers["w0"].address
    before = {k: v.clone() for k, v in servicer.engine.model.state_dict().items()}
    started, busy, reached = threading.Event(), threading.Event(), threading.Event()
    held = asyncio.run_coroutine_threadsafe(servicer.loop.call(lambda: (started.set(), busy.wait(120))),
                                            cluster.loop)  # the engine thread is busy until released
    assert started.wait(60)
    load_when_idle = servicer.loop.call_when_idle

    async def spy(fn):
        reached.set()  # the payload arrived and was verified: the load waits for the engine
        return await load_when_idle(fn)
    servicer.loop.call_when_idle = spy
    try:
        with grpc.insecure_channel(address) as channel:
            call = worker_pb2_grpc.WorkerServiceStub(channel).PushWeights.future(
                weight_chunks(1, weights(seed=1)), timeout=120)
            assert reached.wait(60)
            call.cancel()
            deadline = time.monotonic() + 60
            while REGISTRY.get_sample_value("rhymerl:weight_pushes_in_progress", {"component": "w0"}):
                assert time.monotonic() < deadline, "the worker's push call never ended"
                time.sleep(0.01)
    finally:
        servicer.loop.call_when_idle = load_when_idle
        busy.set()
    held.result(60)
    asyncio.run_coroutine_threadsafe(load_when_idle(lambda: None), cluster.loop).result(60)  # after the queued load
    assert servicer.version == 0
    after = servicer.engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:  # the push itself still works
        assert client.push_weights(1, weights(seed=1)) == 1
    now = servicer.engine.model.state_dict()
    assert servicer.version == 1 and not all(torch.equal(before[k], now[k]) for k in before)


@pytest.mark.parametrize("cluster", [{"weight_push_stall_s": 2.0}], indirect=True)
def test_a_trainer_that_stops_sending_mid_push_gets_deadline_exceeded_and_steps_go_on(cluster):
    """While a push streams, new steps wait for it: a trainer that sends nothing more and
    keeps its connection used to hold them for as long as its own deadline allowed."""
    data = weights()
    held = threading.Event()

    def stalled():
        yield common_pb2.WeightChunk(header=common_pb2.WeightHeader(
            version=1, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
        yield common_pb2.WeightChunk(data=data[:100])
        held.wait(120)
    try:
        with grpc.insecure_channel(cluster.address) as channel, pytest.raises(grpc.RpcError) as err:
            rollout_pb2_grpc.RolloutServiceStub(channel).PushWeights(stalled(), timeout=120)
    finally:
        held.set()
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert err.value.details().startswith("data: no chunk came from the trainer for 2 s")
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.stats().policy_version == 0
        after = client.rollout("after-stalled-push", prompts(2), n=2, sampling=GREEDY)
        assert all(s.policy_version == 0 for s in after.samples)
        assert client.push_weights(1, data) == 1
