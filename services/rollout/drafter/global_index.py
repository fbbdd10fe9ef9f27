"""The worker's global index: recent responses to all prompts, under a token bound.

Responses to one task family share phrasing (the format of a worked step, the way an
answer ends), so a prompt's first epoch, or a turn its own history never took, can still
be drafted from what other prompts' responses did. The index is fed whole responses:
every response that finishes on this worker, and those the history service streams at
step start (`HistoDrafter.add_global_responses`).

Eviction without a stall: two generations, each a `SuffixIndex`. New responses go into
the newest; when it holds half the bound, the older generation is dropped and a fresh
one starts (O(1): no rebuild in the engine's loop). Drafts consult both, so between
flips the index remembers at least the last half-bound of tokens and at most the bound.

A running request follows its longest match in each generation with a `GlobalMatch`,
advanced by the tokens it commits (O(1) amortised per token and generation).
This module knows nothing about prompts, requests or drafting policy.
"""

from __future__ import annotations

from services.rollout.drafter.suffix_index import ROOT, SuffixIndex

_REMATCH_TOKENS = 32  # a tracker entering a fresh generation re-reads this much of its text


class GlobalMatch:
    """A request's longest-match trackers, one per generation (newest first)."""

    __slots__ = ("flips", "lens", "states")

    def __init__(self) -> None:
        self.flips = 0  # the GlobalIndex.flips its states belong to
        self.states = [ROOT, ROOT]
        self.lens = [0, 0]


class GlobalIndex:
    """Recent responses of all prompts in (at most) two suffix-index generations.

    Args:
        max_tokens: the bound on indexed tokens over both generations.
        start: the marker every response starts with (a context of its own).
    """

    def __init__(self, max_tokens: int, start: int) -> None:
        self.max_tokens = max_tokens
        self.start = start
        self.generations: list[SuffixIndex] = [SuffixIndex()]  # newest first
        self.flips = 0  # generations started so far (trackers compare against it)
        self.num_responses = 0

    @property
    def num_tokens(self) -> int:
        return sum(g.num_tokens for g in self.generations)

    def add(self, tokens: list[int]) -> None:
        """Indexes one whole response (without the start marker; it is added here)."""
        sequence = [self.start, *tokens][: self.max_tokens // 2]
        newest = self.generations[0]
        if newest.num_tokens + len(sequence) > self.max_tokens // 2:
            newest = SuffixIndex()
            self.generations = [newest, self.generations[0]]
            self.flips += 1
        last = ROOT
        for i, token in enumerate(sequence):
            last = newest.extend(last, token, 1.0, True, sequence, i)
        self.num_responses += 1

    def follow(self, match: GlobalMatch, text: list[int], new: int) -> None:
        """Advances `match` over the last `new` tokens of `text` (a request's START +
        response so far), first catching up with generations started since."""
        if match.flips != self.flips:
            behind = self.flips - match.flips
            if behind == 1:  # its newest generation is now the older one
                match.states[1], match.lens[1] = match.states[0], match.lens[0]
            else:
                match.states[1], match.lens[1] = self._rematch(self.generations[-1], text)
            match.states[0], match.lens[0] = self._rematch(self.generations[0], text)
            match.flips = self.flips
            if len(self.generations) == 1:
                match.states[1], match.lens[1] = ROOT, 0
            return
        for g, index in enumerate(self.generations):
            state, length = match.states[g], match.lens[g]
            for token in text[len(text) - new:]:
                state, length = index.walk(state, length, token)
            match.states[g], match.lens[g] = state, length

    def start_match(self, text: list[int]) -> GlobalMatch:
        """A tracker for a request whose text (START + tokens) is `text`."""
        match = GlobalMatch()
        match.flips = self.flips
        for g, index in enumerate(self.generations):
            match.states[g], match.lens[g] = self._rematch(index, text)
        return match

    @staticmethod
    def _rematch(index: SuffixIndex, text: list[int]) -> tuple[int, int]:
        state, length = ROOT, 0
        for token in text[-_REMATCH_TOKENS:]:
            state, length = index.walk(state, length, token)
        return state, length

    def approx_bytes(self) -> int:
        return sum(g.approx_bytes() for g in self.generations)
