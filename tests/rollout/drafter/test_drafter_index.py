"""SuffixIndex (weighted generalized suffix automaton) against brute force.

If these fail, drafts start from wrong contexts or weigh continuations wrongly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.drafter.suffix_index import ROOT, SuffixIndex

tokens = st.lists(st.integers(0, 3), max_size=14)
corpora = st.lists(tokens, min_size=1, max_size=4)


def _build(corpus: list[list[int]], propagate: bool, interleave: bool) -> SuffixIndex:
    index = SuffixIndex()
    lasts = [ROOT] * len(corpus)
    if interleave:  # siblings advance one token at a time, round robin
        for pos in range(max(map(len, corpus))):
            for i, seq in enumerate(corpus):
                if pos < len(seq):
                    lasts[i] = index.extend(lasts[i], seq[pos], 1.0, propagate, seq, pos)
    else:
        for i, seq in enumerate(corpus):
            for pos, token in enumerate(seq):
                lasts[i] = index.extend(lasts[i], token, 1.0, propagate, seq, pos)
    if not propagate:
        index.finalize_weights()
    return index


def _count(corpus: list[list[int]], pattern: list[int]) -> int:
    n = len(pattern)
    return sum(seq[i:i + n] == pattern for seq in corpus for i in range(len(seq) - n + 1))


def _brute_longest_suffix(corpus: list[list[int]], text: list[int]) -> int:
    for n in range(len(text), 0, -1):
        if _count(corpus, text[len(text) - n:]) > 0:
            return n
    return 0


def _read(index: SuffixIndex, pattern: list[int]) -> int | None:
    state = ROOT
    for token in pattern:
        state = index.get(state, token)
        if state is None:
            return None
    return state


@settings(max_examples=150, deadline=None)
@given(corpus=corpora, query=tokens, interleave=st.booleans())
def test_tracker_finds_the_longest_suffix_seen(corpus, query, interleave):
    """`walk` must report the longest suffix of the query that occurs in any indexed
    sequence, token by token, for any interleaving of the sequences' appends."""
    index = _build(corpus, propagate=True, interleave=interleave)
    state, match_len = ROOT, 0
    for i, token in enumerate(query):
        state, match_len = index.walk(state, match_len, token)
        assert match_len == _brute_longest_suffix(corpus, query[:i + 1])
        assert index.length[index.link[state]] < match_len <= index.length[state] or match_len == 0


@settings(max_examples=150, deadline=None)
@given(corpus=corpora, propagate=st.booleans(), interleave=st.booleans())
def test_weights_count_occurrences(corpus, propagate, interleave):
    """A state's weight must equal the number of occurrences of its strings, both with
    online propagation (live siblings) and with bulk finalisation (history loads); every
    substring is found, and the state's recorded end position really ends with it (so
    `continuation` reads what followed it)."""
    index = _build(corpus, propagate, interleave)
    substrings = {tuple(seq[i:j]) for seq in corpus for i in range(len(seq)) for j in range(i + 1, len(seq) + 1)}
    for sub in substrings:
        state = _read(index, list(sub))
        assert state is not None
        assert index.weight[state] == _count(corpus, list(sub))
        source, end = index.source[state], index.offset[state]
        assert source[end + 1 - len(sub):end + 1] == list(sub)
        assert index.continuation(state, 3) == source[end + 1:end + 4]
    assert index.num_tokens == sum(map(len, corpus))
    assert index.num_states <= max(1, 2 * index.num_tokens)


@settings(max_examples=100, deadline=None)
@given(first=tokens, later=corpora)
def test_settle_follows_states_split_by_later_appends(first, later):
    """A request remembers (state, match_len); after siblings append more (cloning
    states), `settle` must return the state that now holds that suffix."""
    index = SuffixIndex()
    last = ROOT
    for token in first:
        last = index.extend(last, token)
    remembered = [(last, len(first), first)]
    for seq in later:
        last = ROOT
        for token in seq:
            last = index.extend(last, token)
    for state, match_len, text in remembered:
        for n in range(match_len + 1):
            settled = index.settle(state, n)
            expect = _read(index, text[len(text) - n:])
            if n == 0:
                continue
            assert settled == expect


def test_hand_written_abab():
    """'abab': 'ab' occurs twice and is followed once by 'a'; the tracker of 'xab'
    finds 'ab' (length 2)."""
    index = SuffixIndex()
    last = ROOT
    for token in [0, 1, 0, 1]:
        last = index.extend(last, token)
    ab = _read(index, [0, 1])
    assert index.weight[ab] == 2
    assert [token for token, _ in index.items(ab)] == [0]
    state, match_len = ROOT, 0
    for token in [7, 0, 1]:
        state, match_len = index.walk(state, match_len, token)
    assert (state, match_len) == (ab, 2)


def test_degenerate_repetition_stays_cheap_and_drafts_the_loop():
    """A response stuck repeating one token (common in truncated RL samples) must not
    make each append walk the whole run, and the drafter keeps proposing the loop."""
    from services.rollout.drafter import DrafterConfig, HistoDrafter

    drafter = HistoDrafter(DrafterConfig(min_gain=0.0, max_draft_len=4))
    drafter.start_request("r", "p", [1])
    for _ in range(3000):
        drafter.add_tokens("r", [7])
    assert drafter.propose(["r"], [100]) == [[7, 7, 7, 7]]
