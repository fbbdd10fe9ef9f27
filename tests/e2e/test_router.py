"""Two scheduler shards behind the step router, as real processes over loopback gRPC with
a real redis-server as the shard registry: one step served by both with every sample
once and as one scheduler draws it; rewards and logprobs reports routed to the shard that
made each sample; a weight push reaching both; a stalled shard's groups taken by the
other (tail stealing); a shard killed mid-step losing and duplicating nothing.

Every wait is on state (samples received), never on time. The tests share one cluster
and run in file order: the last one kills a shard."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from rhymerl import Prompt, RolloutClient, SamplingParams
from rhymerl.types import event_samples
from rhymerl.v1 import rollout_pb2, rollout_pb2_grpc

from services.router.local import ShardedCluster
from tests.e2e.cluster import prompts, save_tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SLOTS = 4  # per worker: a shard's window is 4 samples, 2 groups of n=2
PARAMS = SamplingParams(temperature=1.0, max_tokens=24, seed=5, logprobs=True)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    model = save_tiny_model(root / "model")
    # A long TTL: a shard the tests stop (SIGSTOP) stays in the registry; its calls tell.
    cluster = ShardedCluster(model_dir=str(model), num_shards=2, workers_per_shard=1, chunk_tokens=8,
                             max_num_seqs=SLOTS, shard_ttl_s=600.0, log_dir=root / "logs",
                             worker_env={"RHYMERL_WORKER_BATCH_INVARIANT": "1"})  # bitwise logprobs
    with cluster:
        yield cluster


def shard_tokens(cluster: ShardedCluster) -> list[int]:
    out = []
    for shard in cluster.shards:
        with RolloutClient(shard.scheduler_address, timeout_s=10, max_retries=0) as client:
            out.append(client.stats().num_generated_tokens)
    return out


def reference(cluster: ShardedCluster, step_id: str, ps, n: int) -> dict:
    """The same step on one scheduler (shard 0, directly): what the router must return."""
    with RolloutClient(cluster.shards[0].scheduler_address, timeout_s=300, max_retries=0) as client:
        return {s.key: (s.token_ids, s.logprobs) for s in client.rollout(step_id, ps, n=n, sampling=PARAMS).samples}


class Trainer(threading.Thread):
    """Reads one step's stream through the router, keeping every event it gets."""

    def __init__(self, address: str, step_id: str, ps, n: int):
        super().__init__(daemon=True)
        from rhymerl import _calls

        self.address, self.request = address, _calls.step_request(step_id, ps, n, PARAMS, 0)
        self.samples: list[rollout_pb2.SampleResult] = []
        self.summary = None
        self.error = None

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.address) as ch:
                for event in rollout_pb2_grpc.RolloutServiceStub(ch).SubmitStep(self.request, timeout=500):
                    if event.HasField("summary"):
                        self.summary = event.summary
                    else:
                        self.samples.extend(event_samples(event))
        except grpc.RpcError as exc:
            self.error = exc

    def wait_for(self, count: int, timeout_s: float = 400.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.samples) < count:
            assert self.is_alive() and self.error is None, self.error
            assert time.monotonic() < deadline, f"only {len(self.samples)} of {count} samples arrived"
            time.sleep(0.05)

    def keys(self) -> list[tuple[str, int]]:
        return [(s.prompt_id, s.sample_index) for s in self.samples]


def test_two_shards_serve_one_step_as_one_scheduler_does(sharded):
    ps = prompts(8)
    before = shard_tokens(sharded)
    with RolloutClient(sharded.address, timeout_s=300, max_retries=0) as client:
        result = client.rollout("routed", ps, n=2, sampling=PARAMS)
        keys = [s.key for s in result.samples]
        assert sorted(keys) == sorted({(p.prompt_id, k) for p in ps for k in range(2)}), "lost or duplicated"
        assert len(keys) == 16 and all(s.step_id == "routed" for s in result.samples)
        assert result.summary.num_samples == 16
        assert result.summary.num_generated_tokens == sum(len(s.token_ids) for s in result.samples)
        after = shard_tokens(sharded)
        assert all(a > b for a, b in zip(after, before)), "a shard served none of the step"

        assert {s.key: (s.token_ids, s.logprobs) for s in result.samples} == reference(sharded, "direct", ps, 2)

        # re-submitting the step id returns the same samples, not a second batch
        after = shard_tokens(sharded)
        again = client.rollout("routed", ps, n=2, sampling=PARAMS)
        assert {s.key: s.token_ids for s in again.samples} == {s.key: s.token_ids for s in result.samples}
        assert shard_tokens(sharded) == after

        # per-sample reports reach the shard that made each sample
        assert client.report_rewards("routed", [(s.prompt_id, s.sample_index, 1.0) for s in result.samples]) == 16
        mismatch = client.report_logprobs("routed", [(s.prompt_id, s.sample_index, s.logprobs)
                                                     for s in result.samples])
        assert mismatch.num_samples == 16 and mismatch.kl == 0.0
        assert mismatch.num_tokens == mismatch.num_identical_tokens == result.summary.num_generated_tokens
        with pytest.raises(grpc.RpcError) as err:
            client.report_rewards("routed", [("nope", 0, 1.0)])
        assert err.value.code() == grpc.StatusCode.NOT_FOUND and "rewards[0].prompt_id" in err.value.details()


def test_bad_input_names_the_field_in_the_trainers_numbering(sharded):
    ps = prompts(6)
    ps[4] = Prompt("bad", [3, -1, 5])
    with RolloutClient(sharded.address, timeout_s=60, max_retries=0) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.rollout("bad-token", ps, n=2, sampling=PARAMS)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("prompts[4].token_ids")
        with pytest.raises(grpc.RpcError) as err:
            client.rollout("bad-n", prompts(2), n=0, sampling=PARAMS)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("n:")
        with pytest.raises(grpc.RpcError) as err:
            client.rollout("routed", prompts(3), n=2, sampling=PARAMS)  # a known step id, other content
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "step_id" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            client.rollout("too-new", prompts(2), n=2, sampling=PARAMS, policy_version=99)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.details().startswith("policy_version")


def test_a_weight_push_reaches_every_shard(sharded):
    from tests.e2e.test_weight_pushes import weights

    with RolloutClient(sharded.address, timeout_s=300, max_retries=0) as client:
        assert client.push_weights(1, weights()) == 1
        for shard in sharded.shards:
            with RolloutClient(shard.scheduler_address, timeout_s=10, max_retries=0) as direct:
                stats = direct.stats()
                assert stats.policy_version == 1 and all(w.policy_version == 1 for w in stats.workers)
        assert client.stats().policy_version == 1
        step = client.rollout("after-push", prompts(8, offset=40), n=2, sampling=PARAMS)
        assert len(step.samples) == 16 and all(s.policy_version == 1 for s in step.samples)


def test_a_stalled_shards_share_of_the_queue_goes_to_the_other(sharded):
    """Shard 1's scheduler is stopped (SIGSTOP) through the step: it holds the two groups
    it was first given, and shard 0 runs every other group of the step, well beyond its
    own window (a static split by capacity would leave half the step with shard 1)."""
    ps = prompts(12, offset=60)
    sharded.signal_scheduler(1, signal.SIGSTOP)
    try:
        trainer = Trainer(sharded.address, "stolen", ps, 2)
        trainer.start()
        trainer.wait_for(24 - 2 * 2)  # every group but shard 1's first window
    finally:
        sharded.signal_scheduler(1, signal.SIGCONT)
    trainer.join(400)
    assert trainer.error is None and trainer.summary is not None
    assert sorted(trainer.keys()) == sorted({(p.prompt_id, k) for p in ps for k in range(2)})
    assert trainer.summary.num_samples == 24


def test_a_shard_killed_mid_step_loses_and_duplicates_nothing(sharded):
    """Shard 1 holds its groups (stopped) while shard 0 runs the rest; then it is killed
    (kill -9): its groups run on shard 0, and the trainer gets every sample exactly once,
    each with the tokens and logprobs one scheduler draws."""
    ps = prompts(10, offset=80)
    expected = reference(sharded, "killed-reference", ps, 2)
    sharded.signal_scheduler(1, signal.SIGSTOP)
    trainer = Trainer(sharded.address, "killed", ps, 2)
    trainer.start()
    try:
        trainer.wait_for(20 - 2 * 2)
    finally:
        sharded.shards[1].kill("scheduler")
    trainer.join(400)
    assert trainer.error is None and trainer.summary is not None
    assert len(trainer.keys()) == len(set(trainer.keys())) == 20, "lost or duplicated"
    assert {(s.prompt_id, s.sample_index): (list(s.token_ids), list(s.logprobs)) for s in trainer.samples} == expected
