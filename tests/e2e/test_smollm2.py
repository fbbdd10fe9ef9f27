"""The real pretrained checkpoint (SmolLM2-135M-Instruct) through the real services:
SDK -> scheduler -> worker -> history over loopback gRPC and a real redis-server, the
worker loading models/smollm2-135m from disk, batch-invariant, speculation on, the
rollout divided into chunks of 8 tokens (each re-prefilled where it runs).

If this fails, the worker's loading path for a real model (its config keys, tied
embeddings, a chat model's stop token, a 49k vocabulary) has rotted, though every
tiny-model test still passes. Skipped, with the reason, only where the model's package
cannot be fetched.
"""

from __future__ import annotations

import pytest
from rhymerl import Prompt, RolloutClient, SamplingParams

from services.rollout.engine.logprobs import reference_logprobs
from tests.e2e.cluster import Cluster
from tests.smollm2 import chat_prompt_ids, smollm2_checkpoint

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
IM_END = 2


@pytest.fixture(scope="module")
def checkpoint():
    return smollm2_checkpoint()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return transformers.AutoTokenizer.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def client(checkpoint, redis_url):
    cluster = Cluster(model_dir=checkpoint, redis_url=redis_url, num_workers=1, batch_invariant=True).start()
    try:
        with RolloutClient(cluster.address, timeout_s=600, max_retries=2) as c:
            yield c
    finally:
        cluster.stop()


def test_real_model_answers_and_returns_the_trainers_logprobs(client, checkpoint, tokenizer):
    questions = {"france": "What is the capital of France?", "apples": "Tom has 3 apples and buys 5 more. "
                 "How many apples does he have now?"}
    prompts = [Prompt(pid, chat_prompt_ids(tokenizer, text)) for pid, text in questions.items()]
    greedy = client.rollout("greedy", prompts, n=1, sampling=SamplingParams(
        temperature=0.0, max_tokens=24, stop_token_ids=(IM_END,), seed=1))
    answers = {s.prompt_id: tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in greedy.samples}
    assert "Paris" in answers["france"], answers  # a wrongly loaded model says nothing sensible

    sampling = SamplingParams(temperature=1.0, max_tokens=24, stop_token_ids=(IM_END,), seed=3)
    sampled = client.rollout("sampled", prompts, n=2, sampling=sampling)
    assert sorted(s.key for s in sampled.samples) == [("apples", 0), ("apples", 1), ("france", 0), ("france", 1)]
    by_id = {p.prompt_id: p.token_ids for p in prompts}
    expected = reference_logprobs(checkpoint, [(by_id[s.prompt_id], s.token_ids) for s in sampled.samples], sampling)
    for sample, logprobs in zip(sampled.samples, expected):
        assert 0 < len(sample.token_ids) <= 24
        assert sample.token_ids[-1] == IM_END or len(sample.token_ids) == 24
        assert list(sample.logprobs) == logprobs, sample.key
