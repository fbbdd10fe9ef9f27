"""Trainer-matched rollouts end to end, over real gRPC and Redis: two workers in
batch-invariant mode, divided rollout (chunks of 8 tokens, each re-prefilled wherever it
runs), speculation on (tests/rollout/engine/test_reference_logprobs.py forces drafts).

  - the trainer's reference (services/rollout/engine/logprobs.py, from the checkpoint on
    disk) recomputes every returned logprob bit for bit, raw and processed;
  - ReportLogprobs measures the mismatch: 0 for the reference, the right figures for a
    shifted trainer, Prometheus histograms and the step gauges updated, bad reports
    rejected with a status naming the field;
  - seeds: no seed gives fresh samples every step, a step re-generated under its id (after
    the scheduler forgot it) gives the same samples, an explicit seed fixes them.

If these fail, a trainer cannot trust that the rollout's logprobs are its own policy's,
or that its samples are fresh noise each step.
"""

from __future__ import annotations

import math

import grpc
import pytest
from prometheus_client import REGISTRY
from rhymerl import Prompt, RolloutClient, SamplingParams

from tests.e2e.cluster import Cluster, save_tiny_model

pytestmark = pytest.mark.timeout(600)
SAMPLING = SamplingParams(temperature=1.0, top_k=40, max_tokens=24, min_tokens=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(model_dir, redis_url):
    c = Cluster(model_dir=model_dir, redis_url=redis_url, batch_invariant=True,
                scheduler_settings={"max_steps_retained": 3}).start()
    yield c
    c.stop()


@pytest.fixture
def client(cluster):
    with RolloutClient(cluster.address, timeout_s=120, max_retries=2) as c:
        yield c


def prompts(k: int, offset: int = 0) -> list[Prompt]:
    return [Prompt(f"q{offset + i}", [2 + (11 * (offset + i) + 5 * j) % 90 for j in range(5 + i)]) for i in range(k)]


def reference(model_dir, step_prompts, result, sampling):
    from services.rollout.engine.logprobs import reference_logprobs

    token_ids = {p.prompt_id: p.token_ids for p in step_prompts}
    return reference_logprobs(model_dir, [(token_ids[s.prompt_id], s.token_ids) for s in result.samples], sampling)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_reference_recomputes_the_rollout_bit_for_bit_and_the_mismatch_is_zero(client, model_dir, mode):
    sampling = SamplingParams(**{**SAMPLING.__dict__, "logprobs_mode": mode})
    step_prompts = prompts(3)
    result = client.rollout(f"matched-{mode}", step_prompts, n=3, sampling=sampling)
    assert max(len(s.token_ids) for s in result.samples) > 8  # several chunks: KV re-prefilled between them
    expected = reference(model_dir, step_prompts, result, sampling)
    assert [s.logprobs for s in result.samples] == expected
    tokens_before = REGISTRY.get_sample_value("rhymerl:trainer_logprob_abs_diff_count") or 0.0
    identical_before = REGISTRY.get_sample_value("rhymerl:trainer_logprob_abs_diff_bucket", {"le": "0.0"}) or 0.0
    mismatch = client.report_logprobs(f"matched-{mode}", [(s.prompt_id, s.sample_index, lp)
                                                          for s, lp in zip(result.samples, expected)])
    num_tokens = sum(len(s.token_ids) for s in result.samples)
    assert mismatch.num_samples == 9 and mismatch.num_tokens == num_tokens and mismatch.bitwise_identical
    assert mismatch.kl == 0.0 and mismatch.max_abs_diff == 0.0
    assert REGISTRY.get_sample_value("rhymerl:trainer_logprob_abs_diff_count") - tokens_before == num_tokens
    assert REGISTRY.get_sample_value("rhymerl:trainer_logprob_abs_diff_bucket", {"le": "0.0"}) - identical_before \
        == num_tokens
    assert REGISTRY.get_sample_value("rhymerl:step_trainer_logprob_kl") == 0.0


def test_a_shifted_trainer_is_measured_and_bad_reports_are_rejected(client):
    result = client.rollout("shifted", prompts(2, offset=5), n=2, sampling=SAMPLING)
    first = result.samples[0]
    shifted = [(s.prompt_id, s.sample_index, [lp - 0.05 for lp in s.logprobs]) for s in result.samples]
    mismatch = client.report_logprobs("shifted", shifted)
    assert mismatch.num_identical_tokens == 0
    assert mismatch.mean_abs_diff == pytest.approx(0.05, rel=1e-4)
    assert mismatch.mean_log_ratio == pytest.approx(0.05, rel=1e-4)
    assert mismatch.kl == pytest.approx(math.exp(-0.05) - 1 + 0.05, rel=1e-3)
    assert REGISTRY.get_sample_value("rhymerl:step_trainer_logprob_kl") == pytest.approx(mismatch.kl)
    bad = [
        ("no-such-step", [(first.prompt_id, first.sample_index, first.logprobs)], grpc.StatusCode.NOT_FOUND, "step_id"),
        ("shifted", [("nope", 0, [-1.0])], grpc.StatusCode.NOT_FOUND, "samples[0]"),
        ("shifted", [(first.prompt_id, first.sample_index, first.logprobs + [-1.0])],
         grpc.StatusCode.INVALID_ARGUMENT, "samples[0].logprobs"),
        ("shifted", [(first.prompt_id, first.sample_index, [float("nan")] * len(first.logprobs))],
         grpc.StatusCode.INVALID_ARGUMENT, "samples[0].logprobs"),
    ]
    for step_id, samples, code, field in bad:
        with pytest.raises(grpc.RpcError) as err:
            client.report_logprobs(step_id, samples)
        assert err.value.code() == code and field in err.value.details()
    off = client.rollout("no-logprobs", prompts(1, offset=9), n=1,
                         sampling=SamplingParams(**{**SAMPLING.__dict__, "logprobs": False}))
    with pytest.raises(grpc.RpcError) as err:
        client.report_logprobs("no-logprobs", [(s.prompt_id, s.sample_index, [-1.0] * len(s.token_ids))
                                               for s in off.samples])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_without_a_seed_each_step_samples_fresh_noise_and_a_regenerated_step_repeats(client, cluster):
    """Same prompts, no seed: steps differ from each other (and sibling noise differs);
    the first step re-submitted after the scheduler forgot it (max_steps_retained=3) is
    generated again, and comes back the same, logprobs included. A seed fixes samples
    across step ids."""
    step_prompts = prompts(2, offset=20)
    tokens = lambda r: {s.key: s.token_ids for s in r.samples}  # noqa: E731
    first = client.rollout("fresh-0", step_prompts, n=4, sampling=SAMPLING)
    later = [client.rollout(f"fresh-{i}", step_prompts, n=4, sampling=SAMPLING) for i in (1, 2, 3)]
    assert all(tokens(r) != tokens(first) for r in later)
    assert len({tuple(s.token_ids) for s in first.samples}) > 1
    assert len({s.seed for s in first.samples}) == 8
    assert "fresh-0" not in cluster.scheduler.core.steps
    generated = cluster.scheduler.core.num_generated_tokens
    again = client.rollout("fresh-0", step_prompts, n=4, sampling=SAMPLING)
    assert cluster.scheduler.core.num_generated_tokens > generated  # generated anew, not replayed
    assert {s.key: (s.token_ids, s.logprobs, s.seed) for s in again.samples} == \
        {s.key: (s.token_ids, s.logprobs, s.seed) for s in first.samples}
    seeded = SamplingParams(**{**SAMPLING.__dict__, "seed": 123})
    a, b = (client.rollout(f"seeded-{i}", step_prompts, n=4, sampling=seeded) for i in (0, 1))
    assert tokens(a) == tokens(b)


def test_async_client_reports_logprobs_too(client, cluster):
    """AsyncRolloutClient.report_logprobs: the same figures as the sync client's."""
    import asyncio

    from rhymerl import AsyncRolloutClient

    result = client.rollout("async-report", prompts(1, offset=30), n=2, sampling=SAMPLING)
    samples = [(s.prompt_id, s.sample_index, [lp - 0.5 for lp in s.logprobs]) for s in result.samples]

    async def report():
        async with AsyncRolloutClient(cluster.address, timeout_s=60) as aclient:
            return await aclient.report_logprobs("async-report", samples)

    mismatch = asyncio.run(report())
    assert mismatch == client.report_logprobs("async-report", samples)
    assert mismatch.num_samples == 2 and mismatch.mean_abs_diff == pytest.approx(0.5, rel=1e-5)
