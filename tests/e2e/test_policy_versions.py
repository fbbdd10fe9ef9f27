"""What SubmitStepRequest.policy_version means, through the SDK against real services:
the oldest policy the trainer accepts. One above the version serving is refused
(FAILED_PRECONDITION: push it first); one below it, or 0, is served by the version
serving, without an error, and every sample says so in its policy_version (what an
asynchronous, off-policy trainer reads)."""

from __future__ import annotations

import grpc
import pytest
from rhymerl import RolloutClient, SamplingParams

from tests.e2e.cluster import TINY, expect_status, prompts

pytestmark = pytest.mark.timeout(300)
PARAMS = SamplingParams(temperature=1.0, max_tokens=12, seed=3)


def weights(seed: int) -> bytes:
    from safetensors.torch import save

    from services.rollout.loader import init_random_model
    from services.rollout.models.config import ModelConfig

    return save({k: v.contiguous() for k, v in init_random_model(ModelConfig(**TINY), seed=seed).state_dict().items()})


def test_an_older_policy_version_is_served_by_the_current_one(cluster):
    with RolloutClient(cluster.address, timeout_s=120, max_retries=0) as client:
        assert client.push_weights(1, weights(1)) == 1
        assert client.push_weights(2, weights(2)) == 2
        assert client.stats().policy_version == 2  # the version serving, as a trainer reads it
        for asked in (1, 0, 2):
            result = client.rollout(f"asked-v{asked}", prompts(3, offset=60), n=2, sampling=PARAMS,
                                    policy_version=asked)
            assert len(result.samples) == 6
            assert {s.policy_version for s in result.samples} == {2}, asked
            assert all(set(s.token_policy_versions) <= {2} for s in result.samples)
        with pytest.raises(grpc.RpcError) as err:
            client.rollout("asked-v3", prompts(3, offset=60), n=2, sampling=PARAMS, policy_version=3)
        expect_status(err.value, "FAILED_PRECONDITION", "policy_version")
