"""How long drafts should be, from the engine's cost curve (services/rollout/engine/
cost_model.py): the price of one more token in the verify forward at this batch size.

A verify forward over M tokens costs T(M): nearly flat up to a few hundred tokens on an
H100, then growing. With E tokens expected from the step, one more draft token whose
chance of acceptance is g lowers the time per produced token T/E iff
    g > E * (T(M + 1) - T(M)) / T(M),
so the threshold is tiny when few sequences decode (drafts are nearly free: draft long
at the tail) and large in a full batch (only sure tokens pay). M and E come from the
batch size and the drafts' running averages; the walk stops a draft at the threshold.
`trim_to_budget` then enforces the engine's own cap on draft tokens per step.
This module knows nothing about drafts' contents or requests: it sees numbers only.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

from services.rollout.engine.cost_model import CostModel

_SLOPE_SPAN = 16  # tokens over which the curve's slope is read (its points are far apart)


def gain_threshold(cost: CostModel, num_seqs: int, draft_per_seq: float, gain_per_seq: float) -> float:
    """The acceptance chance one more draft token needs to pay for itself.

    Args:
        cost: the engine's cost model (its curve, measured or the H100 prior).
        num_seqs: sequences decoding in the step.
        draft_per_seq: draft tokens per sequence expected in the step.
        gain_per_seq: accepted draft tokens per sequence expected in the step.
    """
    if num_seqs <= 0:
        return 0.0
    num_tokens = max(1, round(num_seqs * (1.0 + draft_per_seq)))
    ms = cost.step_ms(num_tokens)
    slope = (cost.step_ms(num_tokens + _SLOPE_SPAN) - ms) / _SLOPE_SPAN
    return max(0.0, slope) * num_seqs * (1.0 + gain_per_seq) / ms


def trim_to_budget(drafts: list[list[int]], gains: list[list[float]], budget: int) -> int:
    """Cuts the drafts, in place, to the `budget` tokens with the highest gains (prefixes
    of each draft, as gains fall along a draft; ties at the cut go in batch order).

    Returns:
        The number of draft tokens kept.
    """
    total = sum(map(len, drafts))
    if total <= budget:
        return total
    if budget <= 0:
        for i in range(len(drafts)):
            drafts[i], gains[i] = [], []
        return 0
    ranked: Sequence[float] = sorted(itertools.chain.from_iterable(gains), reverse=True)
    threshold = ranked[budget - 1]
    keeps = []
    for g in gains:
        keep = 0
        while keep < len(g) and g[keep] > threshold:
            keep += 1
        keeps.append(keep)
    left = budget - sum(keeps)
    for i, g in enumerate(gains):
        keep = keeps[i]
        while left > 0 and keep < len(g) and g[keep] >= threshold:
            keep += 1
            left -= 1
        drafts[i], gains[i] = drafts[i][:keep], g[:keep]
    return budget


def draft_within_budget(walks: list[Iterator[tuple[int, float]] | None], bounds: list[float],
                        budget: int | None) -> tuple[list[list[int]], list[list[float]]]:
    """The drafts `trim_to_budget` leaves of the walks' whole drafts, computing only the
    tokens that can make the cut: best first, a walk's next token only once every token
    drafted so far with a higher gain was taken. At a full batch the budget is a few
    tokens for a hundred sequences, so most walks stop at their bound or first token.

    Args:
        walks: per request, its draft's (token, gain) pairs as they are computed, gains
            non-increasing (None: no draft).
        bounds: per request, a gain none of its draft's tokens exceeds.
        budget: the most draft tokens kept over the batch (None: no limit, all drafted).
    """
    drafts: list[list[int]] = [[] for _ in walks]
    gains: list[list[float]] = [[] for _ in walks]
    if budget is None:
        for i, walk in enumerate(walks):
            for token, gain in walk or ():
                drafts[i].append(token)
                gains[i].append(gain)
        return drafts, gains
    if budget <= 0:
        return drafts, gains
    heap = [(-bounds[i], i) for i, walk in enumerate(walks) if walk is not None]
    heapq.heapify(heap)
    pending = [False] * len(walks)  # the last token drafted for it is in the heap, not taken
    taken, cut = 0, None
    while heap and (cut is None or -heap[0][0] >= cut):
        key, i = heapq.heappop(heap)
        if pending[i]:  # a drafted token (else a bound: draft the walk's first token)
            pending[i] = False
            taken += 1
            if taken == budget:
                cut = -key  # the budget-th highest gain: the rest only matter if equal
        step = next(walks[i], None)
        if step is not None:
            drafts[i].append(step[0])
            gains[i].append(step[1])
            pending[i] = True
            heapq.heappush(heap, (-step[1], i))
    for i in range(len(walks)):
        if pending[i]:  # drafted below the cut
            drafts[i].pop()
            gains[i].pop()
    trim_to_budget(drafts, gains, budget)  # ties at the cut, as over the whole drafts
    return drafts, gains
