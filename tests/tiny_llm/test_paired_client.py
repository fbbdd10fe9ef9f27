"""PairedClient: the e2e benchmark's two systems see the same calls, the trainer one answer.

If this breaks, benchmarks/e2e_bench.py compares systems that sampled different prompts,
seeds or policies, and its ratio and identical share mean nothing."""

from __future__ import annotations

import pytest
from rhymerl import Prompt, Sample, SamplingParams, StepResult

from benchmarks.tiny_llm.paired_client import PairedClient, identical_share


def sample(prompt_id: str, index: int, tokens: list[int]) -> Sample:
    return Sample(step_id="s", prompt_id=prompt_id, sample_index=index, token_ids=tokens, logprobs=[0.0] * len(tokens),
                  finish_reason="stop", policy_version=0, token_policy_versions=[], num_draft_tokens=0,
                  num_accepted_tokens=0, num_verify_steps=0, num_migrations=0, seed=0)


class Recorder:
    def __init__(self, name: str, log: list, tokens: list[int]):
        self.name, self.log, self.tokens = name, log, tokens

    def rollout(self, step_id, prompts, n, sampling, policy_version=0):
        self.log.append((self.name, "rollout", step_id, tuple(p.prompt_id for p in prompts), n, sampling.seed,
                         policy_version))
        return StepResult(samples=[sample(p.prompt_id, i, self.tokens) for p in prompts for i in range(n)])

    def report_rewards(self, step_id, rewards):
        self.log.append((self.name, "rewards", step_id, tuple(rewards)))
        return len(rewards)

    def push_weights(self, version, data):
        self.log.append((self.name, "weights", version, data))
        return version


def test_both_systems_get_every_call_and_the_trainer_the_reference_answer():
    log, epochs = [], []
    client = PairedClient(Recorder("ref", log, [1, 2]), Recorder("cand", log, [1, 3]),
                          on_epoch=lambda e, a, b: epochs.append((e, a.num_tokens, b.num_tokens)))
    prompts = [Prompt("p0", [5, 6]), Prompt("p1", [7])]
    for epoch in range(3):
        result = client.rollout(f"step{epoch}", prompts, 2, SamplingParams(seed=epoch), policy_version=epoch)
        assert all(s.token_ids == [1, 2] for s in result.samples)  # the reference's samples
        assert client.report_rewards(f"step{epoch}", [("p0", 0, 1.0)]) == 1
        assert client.push_weights(epoch + 1, b"w") == epoch + 1
    rollouts = [entry for entry in log if entry[1] == "rollout"]
    assert [r[0] for r in rollouts] == ["ref", "cand", "cand", "ref", "ref", "cand"]  # who goes first alternates
    for first, second in zip(rollouts[::2], rollouts[1::2]):
        assert first[2:] == second[2:]  # same step id, prompts, n, seed, policy version
    assert [e for e in log if e[0] == "cand" and e[1] == "weights"] == [("cand", "weights", v, b"w") for v in (1, 2, 3)]
    assert epochs == [(0, 8, 8), (1, 8, 8), (2, 8, 8)] and len(client.epochs) == 3
    ref, cand = client.epochs[0]
    assert identical_share(ref.result, cand.result) == 0.0 and identical_share(ref.result, ref.result) == 1.0


def test_a_prompt_set_other_than_the_recorded_one_is_refused():
    log = []
    client = PairedClient(Recorder("ref", log, [1]), Recorder("cand", log, [1]), recorded_prompts={"p0": [5, 6]})
    client.rollout("s", [Prompt("p0", [5, 6])], 1, SamplingParams())
    with pytest.raises(ValueError, match="p0"):
        client.rollout("s", [Prompt("p0", [5, 7])], 1, SamplingParams())
