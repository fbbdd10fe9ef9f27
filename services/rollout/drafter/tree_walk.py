"""One request's draft tree from several suffix indexes: the linear walk's scoring
(walk.py), branching where the sources disagree. Pure functions, no state.

At each node every live source offers the heaviest ``width`` continuations of its
context and the heaviest of its next shorter context; each candidate t is scored by all
sources together, p(t) = sum_s trust_s * p_s(t) / sum_s trust_s (walk._prob, the
estimate the linear walk uses for a candidate), and a child's gain is its parent's times
min(0.99, p(t) * calibration): the modelled chance that the whole path to it is
accepted. Where the sources agree one candidate takes nearly all of p and its siblings'
gains are small; where they disagree two or three children have comparable gains.

The tree grows best first: the next node is the highest-gain candidate of any node
already in the tree. So nodes come out in non-increasing gain (a child never beats its
parent), and every prefix of that order is itself a tree, the one with the largest sum of
gains (the expected accepted tokens) for its size: the budget cut of budget.py
(``draft_within_budget``) can take any prefix, across the batch, as it does for linear
drafts. The walk stops at ``cap`` nodes, below ``min_gain``, at a stop token (no
children) and at ``max_depth``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from services.rollout.drafter.walk import Source, _follow, _prob


def candidates(sources: list[Source], width: int, smoothing: float, backoff: float,
               min_match_len: int) -> list[tuple[float, int]]:
    """(p, token) of the candidates at the sources' current contexts, best first (ties: the
    order in which sources offered them): each source's ``width`` heaviest continuations
    and its next shorter context's heaviest."""
    offered: dict[int, None] = {}
    for s in sources:
        index, state = s[0], s[1]
        offered.update(dict.fromkeys(_heaviest(index, state, width)))
        parent = index.link[state]
        if parent > 0 and index.length[parent] >= min_match_len:
            offered.update(dict.fromkeys(_heaviest(index, parent, 1)))
    trusts = [s[2] / (s[2] + s[3]) for s in sources]
    total = sum(trusts)
    scored = []
    for order, token in enumerate(offered):
        p = sum(t * _prob(s[0], s[1], token, smoothing, backoff) for s, t in zip(sources, trusts)) / total
        scored.append((-p, order, token))
    scored.sort()
    return [(-neg, token) for neg, _, token in scored]


def _heaviest(index, state: int, k: int) -> list[int]:
    """The ``k`` heaviest continuations of a state (first of equal weights in the index's
    order); [] when it was never continued."""
    single = index.one_next[state]
    if single:
        return [index.one_token[state]]
    edges = index.trans[state]
    if not edges:
        return []
    weight = index.weight
    if k == 1:
        best, token = -1.0, None
        for tok, st in edges.items():
            if weight[st] > best:
                best, token = weight[st], tok
        return [token]
    ranked = sorted(enumerate(edges.items()), key=lambda e: (-weight[e[1][1]], e[0]))
    return [tok for _, (tok, _) in ranked[:k]]


def tree_steps(sources: list[Source], gain: float, cap: int, max_depth: int, stops: frozenset[int], width: int,
               smoothing: float, backoff: float, min_match_len: int, min_gain: float, calibration: float,
               parents: list[int]) -> Iterator[tuple[int, float]]:
    """The tree's nodes best first, each as (token, gain), gains non-increasing; each
    node's parent (an earlier node's index, -1: the root) is appended to ``parents`` as
    the node is yielded. ``sources`` (non-empty) are the request's, at its current
    context, with ``initial_gain`` ``gain``; they are not modified."""
    if cap <= 0 or max_depth <= 0:
        return
    tie = itertools.count()  # equal gains: the candidate pushed first
    heap: list = []

    def expand(node_sources: list[Source], node: int, node_gain: float, depth: int) -> None:
        for p, token in candidates(node_sources, width, smoothing, backoff, min_match_len)[:width]:
            q = p * calibration
            child_gain = node_gain * (q if q < 0.99 else 0.99)
            if child_gain >= min_gain:
                heapq.heappush(heap, (-child_gain, next(tie), token, node, node_sources, depth + 1))

    expand(sources, -1, gain, 0)
    num_nodes = 0
    while heap and num_nodes < cap:
        neg_gain, _, token, parent, parent_sources, depth = heapq.heappop(heap)
        parents.append(parent)
        yield token, -neg_gain
        node = num_nodes
        num_nodes += 1
        if token in stops or depth >= max_depth:
            continue
        followed = []
        for s in parent_sources:
            s = s[:]  # the parent's sources serve its other children too
            if _follow(s, token, None, min_match_len):
                followed.append(s)
        if followed:
            expand(followed, node, -neg_gain, depth)
