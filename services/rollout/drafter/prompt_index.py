"""Everything one prompt's drafts are made from, under a token budget.

Three sources feed one `SuffixIndex`: the prompt itself, the responses of earlier epochs
(bulk-loaded, weighted by epoch age and optionally by reward) and the live sequences of
the samples now running on this prompt (the siblings, extended token by token).

Memory is bounded by `max_tokens` indexed tokens (each response also counts one start
marker). Eviction, when a live append would pass the bound: drop the oldest epoch of
history and rebuild (O(tokens), rare); once no history is left, stop indexing live
tokens: sequences keep a longest-match tracker over the frozen index instead. Finished
siblings of the step stay indexed (and survive rebuilds while they fit).
A fresh `set_history` starts over with all sources.

This module knows nothing about drafting policy or acceptance.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.rollout.drafter.suffix_index import ROOT, SuffixIndex

# Every response starts with this marker, so "the start of a response" is a context too:
# the first tokens of a sample are drafted from how earlier responses began.
START = -1


def reward_factors(rewards: Sequence[float], temperature: float) -> list[float]:
    """Per response, exp(temperature * its z-scored reward, clipped to +-3); all 1.0
    when the rewards do not vary."""
    factors = [1.0] * len(rewards)
    if len(rewards) > 1:
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        if std > 1e-9:
            factors = [math.exp(temperature * max(-3.0, min(3.0, (r - mean) / std))) for r in rewards]
    return factors


@dataclass
class HistoryResponse:
    tokens: list[int]  # START, then the response's tokens
    age: int  # 0 = the most recent earlier epoch
    weight: float  # evidence weight of each of its positions


@dataclass
class LiveSequence:
    """A running sample's response so far, and where it stands in the index."""

    tokens: list[int] = field(default_factory=lambda: [START])
    shared: bool = True  # its tokens feed the index (siblings see them)
    indexed: bool = False  # all its tokens are in the index; `state` is its own last state
    state: int = ROOT  # state of the longest suffix of `tokens` found in the index
    match_len: int = 0  # length of that suffix


class PromptIndex:
    """The suffix index of one prompt over its prompt, history and live sequences."""

    def __init__(self, max_tokens: int, sibling_weight: float, prompt_weight: float) -> None:
        self.max_tokens = max_tokens
        self.sibling_weight = sibling_weight
        self.prompt_weight = prompt_weight
        self.index = SuffixIndex()
        self.history: list[HistoryResponse] = []
        self.prompt: list[int] | None = None
        self.live: dict[str, LiveSequence] = {}
        self.finished: list[list[int]] = []  # stopped siblings of this step, kept on rebuilds
        self.frozen = False  # live tokens no longer indexed (budget spent)
        self.released = False  # drop once the last live sequence stops
        self.num_rebuilds = 0

    @property
    def num_tokens(self) -> int:
        return self.index.num_tokens

    def set_history(self, responses: list[HistoryResponse], history_budget: int) -> None:
        """Replaces the history: newest epochs first, whole responses, within the budget."""
        kept, used = [], 0
        for response in sorted(responses, key=lambda r: r.age):
            if used + len(response.tokens) > history_budget:
                break
            kept.append(response)
            used += len(response.tokens)
        self.history = kept
        self.rebuild()

    def set_prompt(self, prompt: list[int]) -> None:
        """Indexes the prompt once (the first sibling to start brings it), if it fits in
        a quarter of the budget."""
        if (self.prompt is not None or len(prompt) > self.max_tokens // 4
                or self.num_tokens + len(prompt) > self.max_tokens):
            return
        self.prompt = list(prompt)
        last = ROOT
        for i, token in enumerate(self.prompt):
            last = self.index.extend(last, token, self.prompt_weight, True, self.prompt, i)

    def add_live(self, request_id: str, seq: LiveSequence) -> None:
        """Registers a running sample and indexes (or tracks) the tokens it already has."""
        self.live[request_id] = seq
        tokens, seq.tokens = seq.tokens, []
        seq.indexed = seq.shared and not self.frozen
        seq.state, seq.match_len = ROOT, 0
        self.append(seq, tokens)

    def finish(self, request_id: str) -> None:
        """A sample stopped: its tokens stay indexed for the siblings still running."""
        seq = self.live.pop(request_id)
        if seq.shared:
            self.finished.append(seq.tokens)

    def append(self, seq: LiveSequence, tokens: list[int]) -> None:
        """Commits tokens to a live sequence. Hot path: O(1) amortised per token."""
        if seq.indexed and self.index.num_tokens + len(tokens) > self.max_tokens:
            self._make_room(len(tokens))
        index = self.index
        if seq.indexed:
            last, weight, source, offset = seq.state, self.sibling_weight, seq.tokens, len(seq.tokens)
            for token in tokens:
                last = index.extend(last, token, weight, True, source, offset)
                offset += 1
            seq.state, seq.match_len = last, index.length[last]
        else:
            state, match_len = seq.state, seq.match_len
            for token in tokens:
                state, match_len = index.walk(state, match_len, token)
            seq.state, seq.match_len = state, match_len
        seq.tokens.extend(tokens)

    def _make_room(self, num_new: int) -> None:
        need = self.num_tokens + num_new
        dropped = False
        while need > self.max_tokens and self.history:
            oldest = max(r.age for r in self.history)
            need -= sum(len(r.tokens) for r in self.history if r.age == oldest)
            self.history = [r for r in self.history if r.age != oldest]
            dropped = True
        if dropped:
            self.rebuild()
        if self.num_tokens + num_new > self.max_tokens:
            self._freeze()

    def _freeze(self) -> None:
        self.frozen = True
        for seq in self.live.values():
            seq.indexed = False  # its tracker (own last state, full length) stays valid

    def rebuild(self) -> None:
        """Builds the index from scratch from the sources kept. O(tokens)."""
        self.num_rebuilds += 1
        index = self.index = SuffixIndex()
        self.frozen = False
        if self.prompt is not None:
            self._insert(self.prompt, self.prompt_weight)
        for response in self.history:
            self._insert(response.tokens, response.weight)
        kept = []
        for tokens in self.finished:
            if index.num_tokens + len(tokens) <= self.max_tokens:
                kept.append(tokens)
                self._insert(tokens, self.sibling_weight)
        self.finished = kept
        tracked = []
        for seq in self.live.values():
            if not seq.shared or index.num_tokens + len(seq.tokens) > self.max_tokens:
                self.frozen = self.frozen or seq.shared
                tracked.append(seq)
                continue
            last = self._insert(seq.tokens, self.sibling_weight)
            seq.indexed, seq.state, seq.match_len = True, last, index.length[last]
        index.finalize_weights()
        for seq in tracked:
            seq.indexed, state, match_len = False, ROOT, 0
            for token in seq.tokens:
                state, match_len = index.walk(state, match_len, token)
            seq.state, seq.match_len = state, match_len

    def _insert(self, tokens: list[int], weight: float) -> int:
        """Bulk-inserts a whole sequence (no weight walk); returns its last state."""
        index, last = self.index, ROOT
        for i, token in enumerate(tokens):
            last = index.extend(last, token, weight, False, tokens, i)
        return last
