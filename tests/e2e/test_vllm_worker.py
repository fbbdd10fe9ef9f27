"""The whole service with two vLLM workers (RHYMERL_WORKER_ENGINE=vllm), each its own
process as in a deployment: worker-0 runs rhymerl's history drafter as vLLM's
proposer, worker-1 runs vLLM without speculation. One cluster for the module
(a vLLM worker takes tens of seconds to start)."""

from __future__ import annotations

import dataclasses

import grpc
import pytest
from rhymerl import Prompt, RolloutClient, SamplingParams

pytest.importorskip("vllm", reason="make install-vllm")

from services.local import LocalCluster
from services.rollout.vllm_engine.smoke import TINY_VLLM, save_tiny_vllm_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, seed=3, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=24, seed=7, ignore_eos=True)


def prompts(k: int, offset: int = 0) -> list[Prompt]:
    return [Prompt(f"v{offset + i}", [3 + (offset + i) % 80, 5, 7, 9, 11, 13]) for i in range(k)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm")
    model = save_tiny_vllm_model(tmp / "model")
    c = LocalCluster(model_dir=str(model), num_workers=2, policy="rhymerl", chunk_tokens=8, log_dir=tmp / "logs",
                     extra_env={"RHYMERL_WORKER_ENGINE": "vllm", "RHYMERL_WORKER_MAX_DRAFT_LEN": "4",
                                "RHYMERL_WORKER_MAX_NUM_SEQS": "32",
                                # no compile warm-up (minutes on 2 cores); the sampler tests keep it
                                "RHYMERL_WORKER_VLLM_ENFORCE_EAGER": "true"},
                     worker_env={"worker-1": {"RHYMERL_WORKER_SPECULATIVE": "false"}})
    c.start(timeout_s=400)
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client(cluster):
    with RolloutClient(cluster.scheduler_address, timeout_s=300) as c:
        yield c


def test_every_sample_returned_exactly_once_with_logprobs(client):
    result = client.rollout("sampled", prompts(4), n=3, sampling=SAMPLED)
    assert sorted(s.key for s in result.samples) == sorted((p.prompt_id, i) for p in prompts(4) for i in range(3))
    for s in result.samples:
        assert len(s.token_ids) == SAMPLED.max_tokens
        assert len(s.logprobs) == len(s.token_ids) and all(lp <= 0.0 for lp in s.logprobs)
        assert all(0 <= t < TINY_VLLM["vocab_size"] for t in s.token_ids)
    # each (prompt, sample) its own seed: a group's samples differ
    by_prompt = {}
    for s in result.samples:
        by_prompt.setdefault(s.key[0], set()).add(tuple(s.token_ids))
    assert all(len(v) == 3 for v in by_prompt.values())


def test_metrics_carry_rhymerl_and_vllm_series(cluster, client):
    """The worker's /metrics: rhymerl's series as on the native worker, vLLM's beside them."""
    from tests.e2e.test_local_processes import metric

    client.rollout("metrics", prompts(2, offset=400), n=2, sampling=SAMPLED)
    texts = [cluster.scrape(f"worker-{i}") for i in range(2)]
    assert sum(metric(t, "rhymerl:generation_tokens_total") for t in texts) >= 4 * SAMPLED.max_tokens
    assert all("vllm:" in t for t in texts)


def test_history_drafts_are_accepted_and_greedy_output_is_unchanged(cluster, client):
    """Epoch 2 drafts from epoch 1's greedy rollouts; its tokens are epoch 1's, whichever
    worker (with or without the proposer) ran each chunk. The drafting worker reports its
    verifies in rhymerl's spec_decode series, fed from vLLM's counts."""
    from tests.e2e.test_local_processes import metric

    ps = prompts(3, offset=100)
    first = client.rollout("epoch-1", ps, n=2, sampling=GREEDY)
    second = client.rollout("epoch-2", ps, n=2, sampling=GREEDY)
    assert second.summary.history_hit_rate == 1.0
    assert {s.key: s.token_ids for s in second.samples} == {s.key: s.token_ids for s in first.samples}
    # greedy siblings are one sequence, whichever worker ran each
    by_prompt = {}
    for s in first.samples:
        by_prompt.setdefault(s.key[0], set()).add(tuple(s.token_ids))
    assert all(len(v) == 1 for v in by_prompt.values())
    assert second.summary.num_draft_tokens > 0
    assert second.summary.num_accepted_tokens >= 0.9 * second.summary.num_draft_tokens
    drafting = cluster.scrape("worker-0")
    assert metric(drafting, "rhymerl:spec_decode_num_accepted_tokens_total") >= second.summary.num_accepted_tokens
    assert metric(drafting, "rhymerl:spec_decode_num_drafts_total") > 0
    assert metric(cluster.scrape("worker-1"), "rhymerl:spec_decode_num_drafts_total") == 0


@pytest.mark.parametrize("change, field", [
    (dict(prompts=[Prompt("big-id", [5, TINY_VLLM["vocab_size"]])]), "prompts[0].token_ids"),
    (dict(prompts=[Prompt("empty", [])]), "prompts[0].token_ids"),
    (dict(sampling=SamplingParams(max_tokens=TINY_VLLM["max_position_embeddings"])), "sampling.max_tokens"),
    (dict(sampling=SamplingParams(temperature=-1.0)), "sampling.temperature"),
    (dict(n=0), "n"),
], ids=["token id >= vocab", "empty prompt", "max_tokens past the model", "temperature < 0", "n = 0"])
def test_bad_input_names_the_field(cluster, change, field):
    args = dict(step_id=f"bad/{field}", prompts=prompts(1), n=1, sampling=GREEDY)
    args.update(change)
    with RolloutClient(cluster.scheduler_address, timeout_s=60, max_retries=0) as c:
        with pytest.raises(grpc.RpcError) as err:
            c.rollout(**args)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field + ":"), err.value.details()


def test_logprobs_vllm_cannot_return_are_refused_per_sample_naming_the_field(client):
    # vLLM's logprobs mode is engine-wide: raw logprobs under top_k cannot be had; the
    # engine-specific refusal is the worker's, so it comes back as each sample's error
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=8, seed=1, logprobs=True)
    result = client.rollout("raw-topk", prompts(1), n=2, sampling=params)
    errors = [s.error for s in result.samples]
    assert len(errors) == 2 and all("logprobs_mode: raw logprobs with top_k" in e for e in errors), errors
    ok = client.rollout("processed-topk", prompts(1), n=2, sampling=dataclasses.replace(params, logprobs_mode="processed"))
    assert all(not s.error and len(s.logprobs) == len(s.token_ids) == 8 for s in ok.samples), [(s.error, len(s.logprobs), len(s.token_ids), s.finish_reason) for s in ok.samples]


def test_min_tokens_longer_than_a_chunk_runs_with_stop_tokens_masked_across_chunks(client):
    # chunks of 8 tokens, min_tokens 13: vLLM refuses a request whose min_tokens exceeds its
    # max_tokens (the chunk's budget), which aborted every such sample with no token
    stops = (5, 7, 9)
    params = SamplingParams(temperature=1.0, max_tokens=24, min_tokens=13, stop_token_ids=stops, seed=2)
    result = client.rollout("min-tokens", prompts(2, offset=400), n=3, sampling=params)
    for s in result.samples:
        assert not s.error and s.finish_reason in ("stop", "length"), (s.error, s.finish_reason)
        assert 13 <= len(s.token_ids) <= 24 and not set(stops) & set(s.token_ids[:13]), s.token_ids


def test_weight_push_and_load_swap_vllm_weights_with_the_version_reported(client, cluster, tmp_path):
    from safetensors.torch import load, save

    ps = prompts(2, offset=300)
    before = client.rollout("w-before", ps, n=2, sampling=GREEDY)
    data = (save_tiny_vllm_model(tmp_path / "other", seed=1) / "model.safetensors").read_bytes()
    partial = load(data)
    partial.pop(sorted(partial)[0])
    with pytest.raises(grpc.RpcError) as err:  # a partial push would mix two versions
        client.push_weights(1, save(partial))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "data" in err.value.details()
    assert all(w.policy_version == 0 for w in client.stats().workers)

    assert client.push_weights(1, data) == 1
    after = client.rollout("w-after", ps, n=2, sampling=GREEDY)
    assert all(s.policy_version == 1 for s in after.samples)
    assert {s.key: s.token_ids for s in after.samples} != {s.key: s.token_ids for s in before.samples}
    assert all(w.policy_version == 1 for w in client.stats().workers)
    assert client.load_weights(2, cluster.model_dir) == 2  # back to the starting weights, by path
    back = client.rollout("w-path", ps, n=2, sampling=GREEDY)
    assert all(s.policy_version == 2 for s in back.samples)
    assert {s.key: s.token_ids for s in back.samples} == {s.key: s.token_ids for s in before.samples}


def test_a_worker_killed_mid_step_loses_no_sample(cluster, client):
    """Last in the module: kills the proposer's worker once the step's first sample is
    back (others are still running); the rest run on worker-1, greedy tokens unchanged."""
    ps = prompts(4, offset=200)
    reference = client.rollout("kill-ref", ps, n=2, sampling=GREEDY)
    got = []
    for sample in client.submit_step("kill", ps, n=2, sampling=GREEDY):
        if not got:
            cluster.kill("worker-0")
        got.append(sample)
    assert sorted(s.key for s in got) == sorted(s.key for s in reference.samples)
    assert {s.key: s.token_ids for s in got} == {s.key: s.token_ids for s in reference.samples}


def test_seeded_samples_repeat_across_reruns_after_the_kill(cluster, client):
    """After the kill only worker-1 (no speculation) serves: a seeded step run twice under
    two step ids gives the same tokens, every sample resumed twice (chunks of 8 tokens,
    each a new vLLM request re-prefilled with the earlier chunks). With drafts, vLLM's
    rejection sampler makes no such promise (docs/vllm.md)."""
    assert not cluster.is_running("worker-0")
    ps = prompts(2, offset=300)
    first = client.rollout("seeded-1", ps, n=2, sampling=SAMPLED)
    again = client.rollout("seeded-2", ps, n=2, sampling=SAMPLED)
    assert {s.key: s.token_ids for s in again.samples} == {s.key: s.token_ids for s in first.samples}
    assert all(len(s.token_ids) == SAMPLED.max_tokens for s in first.samples)
