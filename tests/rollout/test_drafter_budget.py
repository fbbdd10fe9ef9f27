"""Draft budgets from the cost curve, and the n-gram baseline.

If these fail, the engine drafts too much when the batch is full (slower steps) or too
little in the tail, or the baseline we compare against is not vLLM's n-gram lookup."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.drafter import (
    QWEN2_5_0_5B_H100,
    CostCurve,
    NgramContext,
    all_drafts_pay,
    budget_from_gains,
    expected_tokens_per_step,
    propose_ngram,
    uniform_draft_budget,
)


def test_cost_curve_interpolates_and_extrapolates():
    """The docs/cost-model.md points are reproduced, between them linear, beyond the last in
    proportion to tokens (compute-bound); the vectorised form agrees with the scalar."""
    curve = QWEN2_5_0_5B_H100
    assert curve(1) == pytest.approx(0.66)
    assert curve(128) == pytest.approx(0.82)
    assert curve(192) == pytest.approx((0.82 + 0.93) / 2)
    assert curve(1024) == pytest.approx(2.24)
    assert curve(0) == pytest.approx(0.66)
    xs = np.array([0, 1, 5, 100, 300, 512, 700])
    assert np.allclose(curve.many(xs), [curve(x) for x in xs])
    with pytest.raises(ValueError):
        CostCurve((1, 1), (0.5, 0.6))


def test_expected_tokens_per_step_matches_seer_formula():
    """(1 - a^(g+1)) / (1 - a); a = 1 gives g + 1; g = 0 gives 1."""
    assert expected_tokens_per_step(0.5, 0) == pytest.approx(1.0)
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_per_step(1.0, 7) == pytest.approx(8.0)


def test_uniform_budget_is_long_in_the_tail_and_short_when_full():
    """Few sequences: long drafts are nearly free; hundreds: little or no drafting; bad
    acceptance: no drafting at a full batch."""
    curve = QWEN2_5_0_5B_H100
    tail = uniform_draft_budget(curve, 2, 0.8, max_draft_len=16)
    full = uniform_draft_budget(curve, 512, 0.8, max_draft_len=16)
    assert tail / 2 >= 8
    assert full / 512 <= 2
    assert uniform_draft_budget(curve, 512, 0.05) == 0
    assert uniform_draft_budget(curve, 0, 0.9) == 0


@settings(max_examples=30, deadline=None)
@given(gains=st.lists(st.floats(0.0, 1.0), max_size=100), num_seqs=st.integers(1, 700))
def test_budget_from_gains_is_the_best_prefix(gains, num_seqs):
    """budget_from_gains returns the prefix length of the best-first gains that
    minimises time per produced token (checked against an exhaustive scan)."""
    sorted_gains = np.array(sorted(gains, reverse=True))
    n = budget_from_gains(QWEN2_5_0_5B_H100, num_seqs, sorted_gains)
    cost = [QWEN2_5_0_5B_H100(num_seqs + k) / (num_seqs + sorted_gains[:k].sum()) for k in range(len(gains) + 1)]
    assert cost[n] <= min(cost) + 1e-12


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


@settings(max_examples=40, deadline=None)
@given(gains=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=80), num_seqs=st.integers(1, 600))
def test_all_drafts_pay_only_when_the_scan_keeps_everything(gains, num_seqs):
    """The O(1) shortcut may only say "keep all" when the exact scan keeps all."""
    sorted_gains = sorted(gains, reverse=True)
    if all_drafts_pay(QWEN2_5_0_5B_H100, num_seqs, sorted_gains[-1], sum(gains)):
        n = budget_from_gains(QWEN2_5_0_5B_H100, num_seqs, sorted_gains)
        cost = [QWEN2_5_0_5B_H100(num_seqs + k) / (num_seqs + sum(sorted_gains[:k])) for k in range(len(gains) + 1)]
        assert n == len(gains) or cost[-1] <= cost[n] + 1e-12


def test_budget_from_gains_numpy_path_for_large_batches():
    """Past 512 candidates the vectorised path runs; it must pick the same optimum."""
    rng = np.random.default_rng(0)
    for num_seqs in (1, 64, 300):
        sorted_gains = np.sort(rng.random(900) ** 3)[::-1].copy()
        n = budget_from_gains(QWEN2_5_0_5B_H100, num_seqs, sorted_gains)
        cost = np.array([QWEN2_5_0_5B_H100(num_seqs + k) / (num_seqs + sorted_gains[:k].sum())
                         for k in range(len(sorted_gains) + 1)])
        assert cost[n] <= cost.min() + 1e-12
