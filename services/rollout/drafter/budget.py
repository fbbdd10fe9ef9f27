"""How many draft tokens a verify step should carry, from the engine's cost curve.

A verify forward over M tokens costs T(M) (nearly flat up to a few hundred tokens on an
H100, see docs/cost-model.md). Drafting pays when the extra expected tokens outweigh the extra
time, so the right budget depends on the batch size and on how good the drafts are.
Two policies:
- `uniform_draft_budget`: Seer's marginal-benefit rule: every sequence drafts gamma
  tokens with per-token acceptance alpha; pick gamma minimising time per produced token.
- `budget_from_gains`: the same objective with per-token gains from the drafter (the
  estimated probability that the j-th draft token of a sequence is accepted), so the
  budget goes to the drafts most likely to pay.
This module knows nothing about drafts or requests: it sees numbers only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostCurve:
    """Time of one forward as a function of the tokens in it, piecewise linear.

    Attributes:
        num_tokens: increasing token counts M at which the time was measured.
        ms: the measured time of one forward over M tokens, in milliseconds.
    """

    num_tokens: tuple[int, ...]
    ms: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.num_tokens) != len(self.ms) or len(self.ms) < 2:
            raise ValueError("a cost curve needs at least two (num_tokens, ms) points")
        if any(b <= a for a, b in zip(self.num_tokens, self.num_tokens[1:])):
            raise ValueError("num_tokens must increase")
        # Derived once (the curve is frozen): `propose` asks for them every engine step.
        xs, ys = self.num_tokens, self.ms
        slopes = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
        object.__setattr__(self, "_max_slope", max(slopes + [ys[-1] / xs[-1]]))
        object.__setattr__(self, "_table", [])

    def __call__(self, num_tokens: float) -> float:
        """Milliseconds for one forward over `num_tokens`: linear between the measured
        points; past the last one the forward is compute-bound, so time grows in
        proportion to the tokens (conservative: drafts are not free there)."""
        xs, ys = self.num_tokens, self.ms
        if num_tokens >= xs[-1]:
            return ys[-1] * num_tokens / xs[-1]
        if num_tokens <= xs[0]:
            return ys[0]
        i = bisect.bisect_right(xs, num_tokens) - 1
        return ys[i] + (ys[i + 1] - ys[i]) * (num_tokens - xs[i]) / (xs[i + 1] - xs[i])

    @property
    def max_slope(self) -> float:
        """The largest extra milliseconds one more token can cost anywhere on the curve."""
        return self._max_slope

    def table(self, max_tokens: int) -> list[float]:
        """[T(0), T(1), ..., T(max_tokens)] as a list, cached on the curve: the hot path
        indexes it."""
        cached = self._table
        if len(cached) <= max_tokens:
            size = max(1024, 2 * max_tokens)
            cached = self.many(np.arange(size + 1)).tolist()
            object.__setattr__(self, "_table", cached)
        return cached

    def many(self, num_tokens: np.ndarray) -> np.ndarray:
        """`__call__` over an array of token counts."""
        xs, ys = self.num_tokens, self.ms
        out = np.interp(num_tokens, xs, ys)
        beyond = num_tokens > xs[-1]
        out[beyond] = ys[-1] * num_tokens[beyond] / xs[-1]
        return out


# docs/cost-model.md: one H100, bf16, CUDA graphs, Qwen2.5-0.5B shape.
QWEN2_5_0_5B_H100 = CostCurve((1, 32, 128, 256, 512), (0.66, 0.70, 0.82, 0.93, 1.12))


def expected_tokens_per_step(acceptance: float, num_draft: int) -> float:
    """Tokens a sequence gains in one verify step (accepted + bonus) when each of its
    `num_draft` draft tokens is accepted with probability `acceptance` independently."""
    if acceptance >= 1.0:
        return float(num_draft + 1)
    return (1.0 - acceptance ** (num_draft + 1)) / (1.0 - acceptance)


def uniform_draft_budget(curve: CostCurve, num_seqs: int, acceptance: float,
                         max_draft_len: int = 16) -> int:
    """Seer's marginal-benefit budget: gamma* * num_seqs.

    Args:
        curve: the verify cost curve of the engine.
        num_seqs: sequences in the verify step.
        acceptance: expected per-token acceptance probability (0..1).
        max_draft_len: the largest gamma considered.

    Returns:
        The total number of draft tokens for the step (0: do not speculate).
    """
    if num_seqs <= 0:
        return 0
    best_gamma, best_ms_per_token = 0, curve(num_seqs) / num_seqs
    for gamma in range(1, max_draft_len + 1):
        tokens = num_seqs * expected_tokens_per_step(acceptance, gamma)
        ms_per_token = curve(num_seqs * (1 + gamma)) / tokens
        if ms_per_token < best_ms_per_token:
            best_gamma, best_ms_per_token = gamma, ms_per_token
    return best_gamma * num_seqs


_SMALL = 512  # candidates up to which a Python loop beats numpy's fixed costs


def all_drafts_pay(curve: CostCurve, num_seqs: int, min_gain: float, total_gain: float) -> bool:
    """True when every draft token, even the worst, lowers the time per token, so
    `budget_from_gains` would keep them all (O(1): no sort, no scan).

    Token n lowers T/E iff dT_n * E_{n-1} <= g_n * T_{n-1}; with dT_n <= max_slope,
    E_{n-1} <= num_seqs + total_gain and T_{n-1} >= T(num_seqs) this holds for all n when
    min_gain * T(num_seqs) >= max_slope * (num_seqs + total_gain). Typical of the tail.
    """
    return min_gain * curve(num_seqs) >= curve.max_slope * (num_seqs + total_gain)


def budget_from_gains(curve: CostCurve, num_seqs: int, gains: Sequence[float]) -> int:
    """The number of draft tokens, taken best first, that minimises time per token.

    Args:
        curve: the verify cost curve of the engine.
        num_seqs: sequences in the verify step (each yields one token for sure).
        gains: the estimated acceptance probability of every candidate draft token,
            sorted in decreasing order (a list or a [num_candidates] array).

    Returns:
        n such that the step carrying the n best draft tokens has the lowest
        T(num_seqs + n) / (num_seqs + sum(gains[:n])).
    """
    if num_seqs <= 0 or len(gains) == 0:
        return 0
    if len(gains) <= _SMALL:  # numpy's fixed cost would dominate a small batch
        table = curve.table(num_seqs + len(gains))
        # Tokens with a gain above `sure` lower T/E whatever else is taken (see
        # all_drafts_pay): they are kept without scanning, and the best so far is there.
        sure = curve.max_slope * (num_seqs + sum(gains)) / table[num_seqs]
        best_n, expected = 0, float(num_seqs)
        while best_n < len(gains) and gains[best_n] >= sure:
            expected += gains[best_n]
            best_n += 1
        best = table[num_seqs + best_n] / expected
        for n in range(best_n + 1, len(gains) + 1):
            expected += gains[n - 1]
            ms_per_token = table[num_seqs + n] / expected
            if ms_per_token < best:
                best_n, best = n, ms_per_token
        return best_n
    expected = num_seqs + np.cumsum(gains)  # [num_candidates] tokens with n = 1.. drafts
    ms = curve.many(num_seqs + np.arange(1, len(gains) + 1))  # [num_candidates]
    ms_per_token = ms / expected
    best = int(np.argmin(ms_per_token))
    if ms_per_token[best] < curve(num_seqs) / num_seqs:
        return best + 1
    return 0
