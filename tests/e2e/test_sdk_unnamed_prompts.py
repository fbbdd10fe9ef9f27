"""Prompts without a prompt_id (the proto lets the service derive one from the tokens),
through the real SDK against the in-process system on loopback: ``rollout`` returns the
samples in the request's prompt order, and every result maps back to its prompt."""

from __future__ import annotations

import asyncio
import random

import pytest
from rhymerl import AsyncRolloutClient, Prompt, RolloutClient, SamplingParams

from services.common.ids import prompt_id_from_tokens

pytestmark = pytest.mark.timeout(300)
PARAMS = SamplingParams(temperature=1.0, max_tokens=8, seed=3)
UNNAMED = [Prompt("", [3, 4]), Prompt("", [5, 6]), Prompt("", [7, 8])]


def test_the_sdk_derives_the_id_the_service_derives():
    rng = random.Random(0)
    token_lists = [[0], [1, 2, 3], [2**31 - 1, -1, 0, 65_535]] + [
        [rng.randrange(0, 200_000) for _ in range(rng.randrange(1, 300))] for _ in range(50)]
    for tokens in token_lists:
        assert Prompt("", tokens).resolved_id == prompt_id_from_tokens(tokens)
    assert Prompt("named", [1, 2]).resolved_id == "named"


def test_rollout_orders_unnamed_prompts_as_the_request(cluster):
    expected_ids = [prompt_id_from_tokens(p.token_ids) for p in UNNAMED]
    with RolloutClient(cluster.address, timeout_s=120) as client:
        result = client.rollout("unnamed", UNNAMED, n=3, sampling=PARAMS)
        assert [(s.prompt_id, s.sample_index) for s in result.samples] == \
            [(pid, k) for pid in expected_ids for k in range(3)]
        # Every result maps back to its prompt: by position, or by the prompt's resolved id.
        assert result.prompt_ids == expected_ids == [p.resolved_id for p in UNNAMED]
        assert list(result.by_prompt) == expected_ids
        assert [[s.key for s in group] for group in result.groups] == \
            [[(pid, k) for k in range(3)] for pid in expected_ids]
        # The ids the samples carry are the ones later calls take.
        assert client.report_rewards("unnamed", [(*s.key, 1.0) for s in result.samples]) == 9


def test_rollout_orders_named_and_unnamed_prompts_as_the_request(cluster):
    ps = [Prompt("", [9, 10, 11]), Prompt("named-1", [12, 13]), Prompt("", [14, 15]), Prompt("named-0", [16])]
    ids = [prompt_id_from_tokens([9, 10, 11]), "named-1", prompt_id_from_tokens([14, 15]), "named-0"]
    with RolloutClient(cluster.address, timeout_s=120) as client:
        result = client.rollout("mixed", ps, n=2, sampling=PARAMS)
    assert [s.key for s in result.samples] == [(pid, k) for pid in ids for k in range(2)]
    assert result.prompt_ids == ids and list(result.by_prompt) == ids


def test_async_rollout_orders_unnamed_prompts_as_the_request(cluster):
    expected_ids = [prompt_id_from_tokens(p.token_ids) for p in UNNAMED]

    async def main():
        async with AsyncRolloutClient(cluster.address, timeout_s=120) as client:
            return await client.rollout("unnamed-async", UNNAMED, n=3, sampling=PARAMS)

    result = asyncio.run(main())
    assert [s.key for s in result.samples] == [(pid, k) for pid in expected_ids for k in range(3)]
    assert result.prompt_ids == expected_ids
    assert [[s.sample_index for s in group] for group in result.groups] == [[0, 1, 2]] * 3
