"""A weighted generalized suffix automaton over the token sequences of one prompt.

Why a suffix automaton (and not a suffix tree or an n-gram table):
- Appending a token is O(1) amortised and online, so the live tokens of sibling samples
  can be indexed the moment they are committed, in the engine's loop.
- A sequence's own state after its last token *is* its longest-matching-suffix tracker:
  walking up suffix links gives every shorter suffix, so a draft starts from the longest
  context seen anywhere (other epochs, siblings, the prompt, its own earlier text)
  without re-matching a pattern at each step (the 7-down-to-3 search of HistoSpec).
- All occurrences of one context share a state (same end-position set), so a state's
  weight, the summed weight of its end positions, is exactly how often (and from which
  sources) a context was seen; the weight of each outgoing transition's target is how
  often each next token followed it. Drafts follow the heaviest continuation.
- Size is at most 2n states for n tokens with no depth cap (a suffix tree of depth 24
  truncates matches; RL responses repeat spans far longer than that).

Weights: appending position p with weight w adds w to its state and to the states on
its suffix-link chain (exact: 5 states on average, 25 at most on our traces). The walk
stops after MAX_PROPAGATION states, because degenerate repetition ("a a a a ...", a
looping response) makes the chain as long as the run; there the shortest contexts are
under-counted for live tokens only. Bulk loads skip the walk and sum the weights up the
link tree once at the end (`finalize_weights`, exact).

Each state also records one end position (the caller's token list and an index in it),
so the text that followed an occurrence can be read as a slice (`continuation`).

This module knows nothing about requests, prompts, epochs or drafting policy: it stores
sequences of ints with a weight per position and answers transition/weight queries.
"""

from __future__ import annotations

import sys

ROOT = 0
MAX_PROPAGATION = 64  # states a live append updates, at most


class SuffixIndex:
    """Generalized suffix automaton with a float weight per end position.

    A sequence is built by keeping its `last` state (start at `ROOT`) and calling
    `extend(last, token, weight)`, which returns the new `last`. Several sequences may be
    extended in any interleaving.

    Transitions: most states (over 80% on rollouts) have exactly one, kept in two flat
    lists (`one_token`, `one_next`; `one_next` is 0 otherwise: ROOT is never a target);
    only states with two or more get a dict in `trans` (None otherwise). That halves the
    memory of a dict per state and makes the common step of a draft two list reads.
    """

    __slots__ = ("length", "link", "num_tokens", "offset", "one_next", "one_token", "source",
                 "trans", "weight")

    def __init__(self) -> None:
        self.link: list[int] = [-1]  # suffix link per state
        self.length: list[int] = [0]  # length of the longest string in the state
        self.one_token: list[int] = [0]  # the only outgoing token, if exactly one
        self.one_next: list[int] = [0]  # its target state; 0: not exactly one transition
        self.trans: list[dict[int, int] | None] = [None]  # token -> state, if two or more
        self.weight: list[float] = [0.0]  # summed weight of the state's end positions
        # One end position of the state: the token list it lies in (the caller's list,
        # which may keep growing) and its index there. The text after it is a ready-made
        # continuation of every string of the state.
        self.source: list[list[int] | None] = [None]
        self.offset: list[int] = [0]
        self.num_tokens = 0

    @property
    def num_states(self) -> int:
        return len(self.length)

    # -- transitions -------------------------------------------------------------------

    def get(self, state: int, token: int) -> int | None:
        """The state reached from `state` by `token`, or None."""
        nxt = self.one_next[state]
        if nxt:
            return nxt if self.one_token[state] == token else None
        edges = self.trans[state]
        return edges.get(token) if edges is not None else None

    def has_next(self, state: int) -> bool:
        """Whether anything ever followed the state's strings."""
        return self.one_next[state] != 0 or self.trans[state] is not None

    def items(self, state: int) -> list[tuple[int, int]]:
        """(token, next state) for every transition of the state."""
        nxt = self.one_next[state]
        if nxt:
            return [(self.one_token[state], nxt)]
        edges = self.trans[state]
        return list(edges.items()) if edges is not None else []

    def _add_edge(self, state: int, token: int, nxt: int) -> bool:
        """Adds a transition unless `token` already has one; returns whether it added."""
        one_next, trans = self.one_next, self.trans
        single = one_next[state]
        if single:
            if self.one_token[state] == token:
                return False
            trans[state] = {self.one_token[state]: single, token: nxt}
            one_next[state] = 0
            return True
        edges = trans[state]
        if edges is None:
            self.one_token[state] = token
            one_next[state] = nxt
            return True
        if token in edges:
            return False
        edges[token] = nxt
        return True

    def _redirect(self, p: int, token: int, old: int, new: int) -> None:
        """Points `token` at `new` instead of `old` from p and its suffixes that did."""
        one_token, one_next, trans, link = self.one_token, self.one_next, self.trans, self.link
        while p != -1:
            single = one_next[p]
            if single:
                if single != old or one_token[p] != token:
                    return
                one_next[p] = new
            else:
                edges = trans[p]
                if edges is None or edges.get(token) != old:
                    return
                edges[token] = new
            p = link[p]

    # -- building ----------------------------------------------------------------------

    def _clone(self, q: int, length: int, propagate: bool) -> int:
        # The clone takes q's shorter strings; its end positions are q's (plus the new
        # one, added by the caller's weight walk), so with exact weights it starts at q's.
        # Appended inline (live tokens clone a state every other append).
        edges, link = self.trans[q], self.link
        clone = len(link)
        link.append(link[q])
        self.length.append(length)
        self.one_token.append(self.one_token[q])
        self.one_next.append(self.one_next[q])
        self.trans.append(dict(edges) if edges is not None else None)
        self.weight.append(self.weight[q] if propagate else 0.0)
        self.source.append(self.source[q])
        self.offset.append(self.offset[q])
        link[q] = clone
        return clone

    def extend(self, last: int, token: int, weight: float = 1.0, propagate: bool = True,
               source: list[int] | None = None, offset: int = 0) -> int:
        """Appends `token` to the sequence whose current state is `last`.

        Args:
            last: the sequence's state before the token (`ROOT` for an empty sequence).
            token: the token id.
            weight: the weight of this position (how much it counts as evidence).
            propagate: False during bulk loads; call `finalize_weights` afterwards.
            source, offset: the caller's token list holding this token, and its index
                there (`continuation` reads on from it); None: no continuation.

        Returns:
            The sequence's state after the token.
        """
        # Hot path (every live token): `get`, a new state's appends and `_add_edge` are inlined.
        length, link, w = self.length, self.link, self.weight
        one_token, one_next, trans = self.one_token, self.one_next, self.trans
        self.num_tokens += 1
        single = one_next[last]
        if single:
            q = single if one_token[last] == token else None
        else:
            edges = trans[last]
            q = edges.get(token) if edges is not None else None
        if q is not None:  # the extended string already exists (generalized SAM case)
            if length[q] == length[last] + 1:
                state = q
            else:
                state = self._clone(q, length[last] + 1, propagate)
                self._redirect(last, token, q, state)
        else:
            state = len(length)
            link.append(ROOT)
            length.append(length[last] + 1)
            one_token.append(0)
            one_next.append(0)
            trans.append(None)
            w.append(0.0)
            self.source.append(source)
            self.offset.append(offset)
            p = last
            while p != -1:  # add token -> state from p and its suffixes that lack one
                single = one_next[p]
                if single:
                    if one_token[p] == token:
                        q = single
                        break
                    trans[p] = {one_token[p]: single, token: state}
                    one_next[p] = 0
                else:
                    edges = trans[p]
                    if edges is None:
                        one_token[p] = token
                        one_next[p] = state
                    else:
                        q = edges.get(token)
                        if q is not None:
                            break
                        edges[token] = state
                p = link[p]
            if p != -1:  # q: p's existing transition on token
                if length[p] + 1 == length[q]:
                    link[state] = q
                else:
                    clone = self._clone(q, length[p] + 1, propagate)
                    self._redirect(p, token, q, clone)
                    link[state] = clone
        if not propagate:
            w[state] += weight
            return state
        s, depth = state, MAX_PROPAGATION
        while s > ROOT and depth:  # the new position ends every suffix on the chain
            w[s] += weight
            s = link[s]
            depth -= 1
        return state

    def finalize_weights(self) -> None:
        """Turns per-state direct weights (bulk mode) into end-position sums. O(states)."""
        w, link, length = self.weight, self.link, self.length
        buckets: list[list[int]] = [[] for _ in range(max(length) + 1)]
        for state in range(1, len(length)):
            buckets[length[state]].append(state)
        for bucket in reversed(buckets):
            for state in bucket:
                parent = link[state]
                if parent > ROOT:
                    w[parent] += w[state]

    def continuation(self, state: int, max_len: int) -> list[int]:
        """Up to `max_len` tokens that followed one occurrence of the state's strings."""
        source = self.source[state]
        if source is None:
            return []
        start = self.offset[state] + 1
        return source[start:start + max_len]

    def walk(self, state: int, match_len: int, token: int) -> tuple[int, int]:
        """Advances a longest-match tracker by one token of text that is not indexed.

        Returns:
            (state, match_len) of the longest suffix of the text seen in the index.
        """
        link, length, get = self.link, self.length, self.get
        state = self.settle(state, match_len)
        nxt = get(state, token)
        while nxt is None and state != ROOT:
            state = link[state]
            match_len = length[state]
            nxt = get(state, token)
        if nxt is None:
            return ROOT, 0
        return nxt, match_len + 1

    def settle(self, state: int, match_len: int) -> int:
        """The state that holds the suffix of length `match_len` now.

        A state remembered earlier may since have been split by a clone that took its
        shorter strings; the string is then in an ancestor on the suffix-link chain.
        """
        link, length = self.link, self.length
        while state > ROOT and match_len <= length[link[state]]:
            state = link[state]
        return state

    def approx_bytes(self) -> int:
        """The Python heap this index holds: the lists, the transition dicts, and one
        boxed int/float per entry (small ints are shared; counted anyway). O(states):
        for reporting, not for the hot path."""
        lists = (self.link, self.length, self.one_token, self.one_next, self.trans, self.weight,
                 self.source, self.offset)
        total = sum(sys.getsizeof(x) for x in lists)
        total += sum(sys.getsizeof(t) for t in self.trans if t is not None)
        return total + self.num_states * (28 + 28 + 28 + 24 + 28)
