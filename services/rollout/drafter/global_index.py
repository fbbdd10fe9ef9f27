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

The requests running on this worker are indexed as they grow, token by token, as vLLM's
suffix method does: the step's other prompts and samples, sampled by the very policy being
drafted for, are the freshest evidence of how it phrases things now. A request's own text
is then its longest match in the newest generation (its `GlobalMatch` keeps its last
state there); in the older generation it follows its longest match. When its response
finishes and the worker adds it as a whole (`add`), it is recognised and not indexed twice.
This module knows nothing about prompts, requests or drafting policy.
"""

from __future__ import annotations

from collections import OrderedDict

from services.rollout.drafter.suffix_index import ROOT, SuffixIndex

_REMATCH_TOKENS = 32  # a request entering a fresh generation re-reads (re-indexes) this much
_MAX_FED = 4096  # responses indexed live, remembered so that `add` skips them once
_KEY_TOKENS = 16  # how many of their first tokens look them up


class GlobalMatch:
    """A running request in the global index: the last state of its own text in the
    newest generation (states[0], of length lens[0]), and its longest match in the older
    one (states[1], lens[1])."""

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
        # stopped requests indexed live, by their first tokens: (text, flips, its last state)
        self._fed: OrderedDict[int, list[tuple[list[int], int, int]]] = OrderedDict()

    @property
    def num_tokens(self) -> int:
        return sum(g.num_tokens for g in self.generations)

    def add(self, tokens: list[int]) -> None:
        """Indexes one whole response (without the start marker; it is added here),
        unless it is one of this worker's that was indexed as it was generated."""
        if self._indexed_live(tokens):
            return
        sequence = [self.start, *tokens][: self.max_tokens // 2]
        newest = self._room(len(sequence))
        last = ROOT
        for i, token in enumerate(sequence):
            last = newest.extend(last, token, 1.0, True, sequence, i)
        self.num_responses += 1

    def start_match(self, text: list[int]) -> GlobalMatch:
        """Starts indexing a running request whose text (START + tokens) is `text`; the
        list is the request's own, which the caller extends before each `follow`."""
        match = GlobalMatch()
        self._enter(match, text, 0, carried=False)
        return match

    def follow(self, match: GlobalMatch, text: list[int], new: int) -> None:
        """Indexes the last `new` tokens of `text` after the request's earlier ones and
        advances its match in the older generation (new=0: only catches up with flips)."""
        newest = self.generations[0]
        if match.flips != self.flips or newest.num_tokens + new > self.max_tokens // 2:
            self._enter(match, text, new, carried=True)
            return
        begin = len(text) - new
        if len(self.generations) > 1:
            older, state, length = self.generations[1], match.states[1], match.lens[1]
            for token in text[begin:]:
                state, length = older.walk(state, length, token)
            match.states[1], match.lens[1] = state, length
        last = match.states[0]
        for i in range(begin, len(text)):
            last = newest.extend(last, text[i], 1.0, True, text, i)
        match.states[0], match.lens[0] = last, newest.length[last]

    def _enter(self, match: GlobalMatch, text: list[int], new: int, carried: bool) -> None:
        """Indexes the tail of the request's text in the newest generation as a sequence
        of its own (at its start, or after a flip: its context is then there), flipping
        first if it does not fit. In the older generation its match is its own text there
        when that is where it was indexed (`carried`), else found anew."""
        was = match.flips
        tail = min(len(text), _REMATCH_TOKENS + new, self.max_tokens // 2)
        newest = self._room(tail)
        if len(self.generations) == 1:
            match.states[1], match.lens[1] = ROOT, 0
        elif carried and self.flips - was == 1:
            state, length = match.states[0], match.lens[0]  # its own text, before the new tokens
            for token in text[len(text) - new:]:
                state, length = self.generations[1].walk(state, length, token)
            match.states[1], match.lens[1] = state, length
        else:
            match.states[1], match.lens[1] = self._rematch(self.generations[1], text)
        last = ROOT
        for i in range(len(text) - tail, len(text)):
            last = newest.extend(last, text[i], 1.0, True, text, i)
        match.states[0], match.lens[0], match.flips = last, newest.length[last], self.flips

    def finish(self, match: GlobalMatch, text: list[int]) -> None:
        """A running request stopped: its text (START + tokens) is indexed already, so
        `add` will recognise its response once (and index only what it lacks)."""
        key = hash(tuple(text[1:1 + _KEY_TOKENS]))
        self._fed.setdefault(key, []).append((text, match.flips, match.states[0]))
        self._fed.move_to_end(key)
        if len(self._fed) > _MAX_FED:
            self._fed.popitem(last=False)

    def _indexed_live(self, tokens: list[int]) -> bool:
        """Whether `tokens` is a response that ran here; the engine stops a request before
        handing the drafter its last tokens, so those are indexed after its text now."""
        found = self._take_fed(tokens)
        if found is None:
            return False
        text, flips, last = found
        done, newest = len(text) - 1, self.generations[0]
        if flips != self.flips or newest.num_tokens + len(tokens) - done > self.max_tokens // 2:
            return done == len(tokens)  # its text moved on to an older generation: index it anew
        for i in range(done, len(tokens)):
            last = newest.extend(last, tokens[i], 1.0, True, tokens, i)
        return True

    def _take_fed(self, tokens: list[int]) -> tuple[list[int], int, int] | None:
        """Removes and returns the stopped request whose response `tokens` begins with."""
        for k in range(min(_KEY_TOKENS, len(tokens)), -1, -1):  # a text shorter than the key: its length
            entries = self._fed.get(hash(tuple(tokens[:k])))
            for n, (text, flips, last) in enumerate(entries or ()):
                if len(text) - 1 <= len(tokens) and text[1:] == tokens[:len(text) - 1]:
                    del entries[n]
                    if not entries:
                        del self._fed[hash(tuple(tokens[:k]))]
                    return text, flips, last
        return None

    def _room(self, num_new: int) -> SuffixIndex:
        """The newest generation, after a flip if it cannot take `num_new` more tokens."""
        newest = self.generations[0]
        if newest.num_tokens + num_new > self.max_tokens // 2 and newest.num_tokens:
            newest = SuffixIndex()
            self.generations = [newest, self.generations[0]]
            self.flips += 1
        return newest

    @staticmethod
    def _rematch(index: SuffixIndex, text: list[int]) -> tuple[int, int]:
        state, length = ROOT, 0
        for token in text[-_REMATCH_TOKENS:]:
            state, length = index.walk(state, length, token)
        return state, length

    def approx_bytes(self) -> int:
        return sum(g.approx_bytes() for g in self.generations)
