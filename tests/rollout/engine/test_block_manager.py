"""BlockManager: ref-counted prefix sharing, rollback, the prefix cache and its eviction
order. If these fail, siblings stop sharing prompt KV (or share the wrong KV), blocks
leak, or a freed block is reused while still referenced."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.engine.block_manager import BlockManager
from services.rollout.engine.request import EngineRequest
from services.rollout.engine.sequence import Sequence


def seq_of(tokens: list[int], rid: str = "r") -> Sequence:
    req = EngineRequest(request_id=rid, prompt_id="p", step_id="s", sample_index=0, prompt_token_ids=list(tokens),
                        generated_token_ids=[], temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                        max_tokens=100, max_new_tokens=100, stop_token_ids=frozenset(), min_tokens=0,
                        ignore_eos=True, logprobs=False)
    return Sequence(req, (), max_model_len=1000)


def admit(bm: BlockManager, seq: Sequence) -> list[int]:
    cached = bm.cached_prefix(seq)
    assert bm.num_new_blocks_to_admit(seq, cached) <= bm.num_free_blocks
    bm.admit(seq, cached)
    return cached


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """As the engine does after the forward that computed the whole sequence but its last token."""
    seq.num_computed_tokens = seq.num_tokens - 1
    bm.commit(seq)


def test_siblings_share_full_prompt_blocks_only():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(10, 20))  # 2 full blocks + 2 tokens
    leader = seq_of(prompt, "a")
    assert admit(bm, leader) == [] and len(leader.block_table) == 3
    compute_all(bm, leader)
    sibling = seq_of(prompt, "b")
    cached = admit(bm, sibling)
    assert cached == leader.block_table[:2]
    assert sibling.num_computed_tokens == 8
    assert sibling.block_table[2] != leader.block_table[2]  # the partial block is its own
    assert [bm.ref_counts[b] for b in cached] == [2, 2]
    bm.free(leader)
    assert [bm.ref_counts[b] for b in cached] == [1, 1]
    bm.free(sibling)
    assert bm.num_free_blocks == 16


def test_whole_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of(list(range(8)), "a")
    admit(bm, a)
    a.num_computed_tokens = 8
    bm.commit(a)
    b = seq_of(list(range(8)), "b")
    assert admit(bm, b) == a.block_table[:1]  # block 2 is recomputed for the last token's logits
    assert b.num_uncomputed == 4


def test_different_prefix_does_not_match():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(bm, a)
    compute_all(bm, a)
    assert bm.cached_prefix(seq_of([1, 2, 3, 4, 5, 6, 7, 0, 9])) == a.block_table[:1]
    assert bm.cached_prefix(seq_of([0, 2, 3, 4, 5, 6, 7, 8, 9])) == []


def test_truncate_rolls_back_draft_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq_of([1, 2, 3])
    admit(bm, s)
    assert bm.ensure_slots(s, 3 + 6) and len(s.block_table) == 3  # room for a 6-token draft
    bm.truncate(s, 5)
    assert len(s.block_table) == 2 and bm.num_free_blocks == 6


def test_ensure_slots_fails_without_side_effects():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq_of([1, 2, 3])
    admit(bm, s)
    assert not bm.ensure_slots(s, 12)
    assert len(s.block_table) == 1 and bm.num_free_blocks == 1


def test_freed_blocks_stay_cached_until_reused():
    """A freed prompt block is found again (a resumed chunk skips recompute); unhashed
    free blocks are handed out before cached ones."""
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq_of(list(range(9)), "a")
    admit(bm, a)
    compute_all(bm, a)
    shared = a.block_table[:2]
    bm.free(a)
    b = seq_of(list(range(9)) + [50], "b")
    assert admit(bm, b) == shared  # revived from the free pool
    assert bm.num_free_blocks == 1
    bm.free(b)
    c = seq_of([7, 7, 7])
    admit(bm, c)
    assert c.block_table[0] not in shared  # the unhashed block went first
    bm.reset_prefix_cache()
    assert bm.cached_prefix(seq_of(list(range(9)))) == []


def test_admission_counts_revived_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = seq_of(list(range(9)), "a")
    admit(bm, a)
    compute_all(bm, a)
    bm.free(a)
    b = seq_of(list(range(9)), "b")
    cached = bm.cached_prefix(b)
    assert len(cached) == 2 and bm.num_new_blocks_to_admit(b, cached) == 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 14)), min_size=1, max_size=30))
def test_ref_counts_match_block_tables(ops):
    """Random admit/grow/free sequences: every block's ref count equals the number of
    tables holding it, and free blocks are exactly the unreferenced ones."""
    bm = BlockManager(num_blocks=12, block_size=4)
    live: list[Sequence] = []
    for i, (op, n) in enumerate(ops):
        if op <= 1:
            s = seq_of([(op * 5 + j) % 3 for j in range(n)], f"s{i}")
            cached = bm.cached_prefix(s)
            if bm.num_new_blocks_to_admit(s, cached) <= bm.num_free_blocks:
                bm.admit(s, cached)
                compute_all(bm, s)
                live.append(s)
        elif op == 2 and live:
            s = live[n % len(live)]
            if bm.ensure_slots(s, s.num_tokens + n):
                bm.truncate(s, s.num_tokens + n // 2)
        elif live:
            bm.free(live.pop(n % len(live)))
        counts = [0] * bm.num_blocks
        for s in live:
            for b in s.block_table:
                counts[b] += 1
        assert counts == bm.ref_counts
        assert set(bm.free_blocks) == {b for b in range(bm.num_blocks) if counts[b] == 0}


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def _hash_state(bm: BlockManager) -> tuple:
    return dict(bm.hash_to_block), list(bm.block_hashes), list(bm.block_tokens), list(bm.num_hashed_blocks.values())


def _filled_twins(later: bool) -> tuple[BlockManager, Sequence, Sequence]:
    """Two sequences with the same tokens, each filling its first block in the same step,
    committed at once or put off (``commit_later``)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b = seq_of([1, 2, 3, 4, 5], "a"), seq_of([1, 2, 3, 4, 5], "b")
    for s in (a, b):
        admit(bm, s)
    for s in (a, b):
        s.num_computed_tokens = 4
        (bm.commit_later if later else bm.commit)(s)
    return bm, a, b


def test_hashing_put_off_waits_for_hash_filled_then_equals_hashing_at_once():
    """Breaks if commit_later hashes at once (nothing would be taken off the step's path),
    or if hash_filled hashes in another order than the commits (the first filled block of
    two with the same tokens is the one a later sibling shares)."""
    at_once, a0, _ = _filled_twins(later=False)
    bm, a, b = _filled_twins(later=True)
    assert bm.hash_to_block == {} and bm.block_hashes[a.block_table[0]] is None
    bm.hash_filled()
    assert _hash_state(bm) == _hash_state(at_once)
    assert bm.hash_to_block[bm.block_hashes[a.block_table[0]]] == a.block_table[0]  # a's, filled first


@pytest.mark.parametrize("first", ["cached_prefix", "free", "reset_prefix_cache"])
def test_reading_or_dropping_the_hashes_hashes_the_waiting_blocks_first(first):
    """Breaks if an admission misses a block filled in the last step (its prompt KV
    recomputed instead of shared), a freed sequence's filled blocks leave the prefix cache
    unhashed, or a weight update leaves blocks of the old weights to be hashed after it."""
    at_once, a0, b0 = _filled_twins(later=False)
    bm, a, b = _filled_twins(later=True)
    sibling = [1, 2, 3, 4, 9]
    if first == "cached_prefix":
        assert bm.cached_prefix(seq_of(sibling, "c")) == [a.block_table[0]]
    elif first == "free":
        bm.free(b)
        at_once.free(b0)
        assert bm.cached_prefix(seq_of(sibling, "c")) == [a.block_table[0]]
    else:
        bm.reset_prefix_cache()
        at_once.reset_prefix_cache()
        bm.commit(a)  # (a later step's commit: the old blocks stay forgotten)
        at_once.commit(a0)
        assert bm.cached_prefix(seq_of(sibling, "c")) == []
    assert _hash_state(bm) == _hash_state(at_once)
