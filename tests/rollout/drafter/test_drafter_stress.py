"""The drafter driven as the engine drives it, in random interleavings, under memory
pressure: rebuilds, freezing and shadows must never leave a stale state behind.

A regression test for a crash seen under load (2 workers, 24 prompts x 8 samples,
512 tokens): a draft walked from a state id of an index that had since been rebuilt.
"""

from __future__ import annotations

import random

import pytest

from services.rollout.drafter import DrafterConfig, HistoDrafter


def _run(seed: int, max_tokens_per_prompt: int, steps: int = 400) -> HistoDrafter:
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12])  # tiny vocabularies repeat a lot: long matches, clones
    drafter = HistoDrafter(DrafterConfig(max_tokens_per_prompt=max_tokens_per_prompt, max_draft_len=8,
                                         min_match_len=1, global_max_tokens=max_tokens_per_prompt))
    prompts = [f"p{i}" for i in range(3)]
    for prompt_id in prompts:
        history = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 60))] for _ in range(6)]
        drafter.load_history(prompt_id, history, epoch_ages=[i // 2 for i in range(6)])
    running: dict[str, list[int]] = {}
    next_id = 0
    for _ in range(steps):
        if len(running) < 6 and rng.random() < 0.3:
            rid = f"r{next_id}"
            next_id += 1
            resumed = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
            drafter.start_request(rid, rng.choice(prompts), [1, 2, 3], resumed)
            running[rid] = list(resumed)
        if rng.random() < 0.03:  # a new step of a prompt arrives while its samples run
            history = [[rng.randrange(vocab) for _ in range(rng.randrange(1, 80))] for _ in range(4)]
            drafter.load_history(rng.choice(prompts), history, epoch_ages=[0, 0, 1, 1])
        if running and rng.random() < 0.05:  # a chunk ends; the sample resumes here later
            rid = rng.choice(list(running))
            prompt_id = drafter._requests[rid].prompt_id
            drafter.stop_request(rid)
            drafter.start_request(rid, prompt_id, [1, 2, 3], running[rid])
        if not running:
            continue
        ids = [rid for rid in running if rng.random() < 0.8]  # prefilling ones are not asked
        max_lens = [rng.randrange(0, 9) for _ in ids]
        budget = rng.choice([None, 0, 3, 20])
        drafts = drafter.propose(ids, max_lens, [frozenset({0})] * len(ids), budget=budget)
        for rid, draft, cap in zip(ids, drafts, max_lens):
            assert len(draft) <= cap
            assert 0 not in draft[:-1]  # never past a stop token
            accepted = 0
            while accepted < len(draft) and rng.random() < 0.6:
                accepted += 1
            committed = draft[:accepted] + [rng.randrange(vocab)]
            if draft and rng.random() < 0.1:  # the engine dropped the draft (no free KV)
                committed = committed[-1:]
            else:
                drafter.record_acceptance(rid, len(draft), accepted)
            drafter.add_tokens(rid, committed)
            running[rid].extend(committed)
        for rid in ids:
            if rng.random() < 0.05:
                drafter.stop_request(rid)
                drafter.add_global_responses([running.pop(rid)])  # a finished sample, as a worker feeds it
        if rng.random() < 0.02:
            drafter.release_prompt(rng.choice(prompts))
    return drafter


@pytest.mark.parametrize("seed", range(40))
def test_random_engine_interleavings_under_memory_pressure_never_fail(seed):
    drafter = _run(seed, max_tokens_per_prompt=rng_bound(seed))
    for prompt_id in ("p0", "p1", "p2"):
        assert drafter.memory_tokens(prompt_id) <= rng_bound(seed)
    assert drafter.global_tokens() <= rng_bound(seed)


def rng_bound(seed: int) -> int:
    return (64, 160, 400, 4096)[seed % 4]
