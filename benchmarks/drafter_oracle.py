"""The ceiling of chain drafting from rhymerl's sources: a drafter that knows the truth.

At every verify step the oracle drafts the longest run of the trace's next tokens that
some source has seen after the request's current context: for each source (the
prompt's index: earlier epochs, live siblings, the prompt, the request's own text; and
the generations of the global index) and each suffix of the request's text at least
`min_match_len` long that occurs there (the suffix-link chain of its match), it follows
the true next tokens through the index's transitions as far as they go. Every drafted
token is accepted, so its accepted/verify is the most any linear drafter reading these
sources with these contexts could accept, and its drafted/verify equals it (no token is
wasted). With `longest_only`, only the longest context that was continued in each
source counts (the context rhymerl's walk and the peer's tree start from): what
perfect choice among that context's continuations would accept. It goes through the same replay as every other drafter; the sources are
HistoDrafter's own (this class drives one and reads its indexes).

This is a benchmark instrument, not a drafter: it needs the answer.
"""

from __future__ import annotations

from services.rollout.drafter import DrafterConfig, HistoDrafter
from services.rollout.drafter.suffix_index import SuffixIndex


class OracleDrafter:
    """The engine-facing calls of a drafter; `truth` maps request id -> its response."""

    def __init__(self, truth: dict[str, list[int]], config: DrafterConfig, max_len: int = 16,
                 longest_only: bool = False) -> None:
        self.truth = truth
        self.longest_only = longest_only
        self.max_len = max_len
        self.inner = HistoDrafter(config)
        self.pos: dict[str, int] = {}
        # the lifecycle calls are HistoDrafter's own (they feed the indexes)
        self.load_history = self.inner.load_history
        self.add_global_responses = self.inner.add_global_responses
        self.memory_tokens = self.inner.memory_tokens
        self.memory_bytes = self.inner.memory_bytes
        self.release_prompt = self.inner.release_prompt
        self.global_tokens = self.inner.global_tokens

    def start_request(self, request_id: str, prompt_id: str, prompt: list[int], generated=()) -> None:
        self.inner.start_request(request_id, prompt_id, prompt, generated)
        self.pos[request_id] = len(generated)

    def add_tokens(self, request_id: str, tokens: list[int]) -> None:
        self.inner.add_tokens(request_id, tokens)
        self.pos[request_id] += len(tokens)

    def record_acceptance(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        self.inner.record_acceptance(request_id, num_draft, num_accepted)

    def stop_request(self, request_id: str) -> None:
        self.inner.stop_request(request_id)
        del self.pos[request_id]

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None) -> list[list[int]]:
        return [self._draft(rid, min(self.max_len, m)) for rid, m in zip(request_ids, max_lens)]

    def _draft(self, request_id: str, cap: int) -> list[int]:
        inner = self.inner
        request = inner._requests[request_id]  # noqa: SLF001 (an instrument reading the drafter's sources)
        p = self.pos[request_id]
        want = self.truth[request_id][p:p + cap]
        anchored = len(request.seq.tokens)
        matches = [(inner._prompts[request.prompt_id].index, request.seq.state, request.seq.match_len)]  # noqa: SLF001
        if request.glob is not None:
            glob = inner._global  # noqa: SLF001
            if request.glob.flips != glob.flips:
                glob.follow(request.glob, request.seq.tokens, 0)
            matches += list(zip(glob.generations, request.glob.states, request.glob.lens))
        best = 0
        for index, state, match_len in matches:
            best = max(best, _longest(index, state, match_len, want, inner.config.min_match_len, anchored,
                                      self.longest_only))
        return want[:best]


def _longest(index: SuffixIndex, state: int, match_len: int, want: list[int], min_match_len: int,
             anchored: int, longest_only: bool) -> int:
    """How many of `want` follow some suffix (>= min_match_len, or the whole anchored
    text) of the text whose longest match is (state, match_len); with `longest_only`,
    the longest suffix that was continued only."""
    state = index.settle(state, match_len)
    if longest_only:
        while state > 0 and not index.has_next(state):
            state = index.link[state]
            match_len = index.length[state]
    best = 0
    while state > 0 and (match_len >= min_match_len or match_len == anchored):
        s, n = state, 0
        while n < len(want):
            nxt = index.get(s, want[n])
            if nxt is None:
                break
            s, n = nxt, n + 1
        best = max(best, n)
        if best == len(want) or longest_only:
            break
        state = index.link[state]
        match_len = index.length[state]
    return best
