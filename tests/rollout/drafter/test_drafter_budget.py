"""Draft length from the engine's cost curve, the engine's budget cap, and the n-gram baseline.

If these fail, the engine drafts too much when the batch is full (slower steps) or too
little in the tail, or the baseline we compare against is not vLLM's n-gram lookup."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.drafter import NgramContext, gain_threshold, propose_ngram, trim_to_budget
from services.rollout.engine.cost_model import CostModel


def test_gain_threshold_is_low_in_the_tail_and_high_in_a_full_batch():
    """On the H100 curve one more token is nearly free for a few sequences and costly for
    hundreds: the acceptance chance a draft token needs grows with the batch."""
    cost = CostModel()
    tail = gain_threshold(cost, 1, 4.0, 1.5)
    full = gain_threshold(cost, 256, 4.0, 1.5)
    assert 0.0 <= tail < 0.02 < 0.2 < full
    assert [gain_threshold(cost, b, 4.0, 1.5) for b in (1, 16, 64, 256)] == sorted(
        gain_threshold(cost, b, 4.0, 1.5) for b in (1, 16, 64, 256))
    flat = CostModel(((1, 1.0), (4096, 1.0)))
    assert gain_threshold(flat, 256, 4.0, 1.5) == 0.0  # a flat curve: every draft pays
    assert gain_threshold(cost, 0, 4.0, 1.5) == 0.0


def test_gain_threshold_is_the_break_even_of_time_per_token():
    """A token with exactly the threshold's gain leaves T/E unchanged (to first order)."""
    cost = CostModel()
    num_seqs, draft, gain = 64, 3.0, 1.2
    g = gain_threshold(cost, num_seqs, draft, gain)
    m, e = round(num_seqs * (1 + draft)), num_seqs * (1 + gain)
    before = cost.step_ms(m) / e
    after = cost.step_ms(m + 16) / (e + 16 * g)  # 16 such tokens
    assert abs(after - before) / before < 1e-9


@settings(max_examples=60, deadline=None)
@given(gains=st.lists(st.lists(st.floats(0.01, 1.0), max_size=8), min_size=1, max_size=6),
       budget=st.integers(0, 40))
def test_trim_keeps_the_best_prefixes_within_the_budget(gains, budget):
    """The kept tokens are prefixes of each draft, at most `budget` of them, and no kept
    token has a lower gain than a dropped one."""
    gains = [sorted(g, reverse=True) for g in gains]
    drafts = [list(range(len(g))) for g in gains]
    kept_gains = [list(g) for g in gains]
    kept = trim_to_budget(drafts, kept_gains, budget)
    assert kept == sum(map(len, drafts)) == min(budget, sum(map(len, gains)))
    for d, g, full in zip(drafts, kept_gains, gains):
        assert d == list(range(len(d))) and g == full[:len(d)]
    dropped = [x for full, g in zip(gains, kept_gains) for x in full[len(g):]]
    taken = [x for g in kept_gains for x in g]
    if dropped and taken:
        assert min(taken) >= max(dropped)


def _reference_ngram(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(-3, 3), max_size=30), k=st.integers(0, 8))
def test_ngram_matches_a_brute_force_lookup(tokens, k):
    """The longest n-gram (2..4) suffix wins, its earliest earlier occurrence is used,
    and the draft stops at the end of the context (vLLM's ngram semantics)."""
    context = NgramContext(tokens[:len(tokens) // 2])
    context.extend(tokens[len(tokens) // 2:])
    assert propose_ngram(context, k, 2, 4) == _reference_ngram(tokens, k, 2, 4)



def test_a_draft_is_priced_at_the_forwards_batch_size():
    """The same request with the same history: priced as one sequence in the forward it
    drafts on past where two earlier responses part; priced as one of 256 it stops
    before (the threshold above). `num_seqs` defaults to the requests proposed for."""
    from services.rollout.drafter import DrafterConfig, HistoDrafter

    drafter = HistoDrafter(DrafterConfig(min_gain=0.0, use_global=False, max_draft_len=8, cost_model=CostModel()))
    drafter.load_history("p", [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 13, 14, 15, 16, 17]])
    drafter.start_request("r", "p", [1, 1])
    [alone] = drafter.propose(["r"], [100])
    [tail] = drafter.propose(["r"], [100], num_seqs=1)
    [full] = drafter.propose(["r"], [100], num_seqs=256)
    assert alone == tail and len(tail) > 3  # past the fork at the fourth token
    assert len(full) < len(tail) and tail[:len(full)] == full
