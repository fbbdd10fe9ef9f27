"""HistoDrafter lifecycle: what the engine relies on.

If these fail, drafts run past stop tokens or max_tokens (wasted or wrong verify work),
siblings stop helping each other, or the per-prompt memory bound is not kept."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.drafter import DrafterConfig, HistoDrafter, UnknownRequestError

RESPONSE = [5, 6, 7, 8, 9, 10, 11, 12, 2]  # ends with EOS = 2
EOS = frozenset([2])


def _fixed(**kwargs) -> HistoDrafter:
    """A drafter that drafts whenever a continuation exists (no gain cut), from the
    prompt's own index only unless told (the global index has its own tests)."""
    kwargs.setdefault("use_global", False)
    return HistoDrafter(DrafterConfig(min_gain=0.0, **kwargs))


def test_history_drafts_the_earlier_response_from_its_start():
    """With one earlier response, a new sample is drafted that response from token 0,
    and after two tokens the rest of it (up to max_draft_len)."""
    drafter = _fixed(max_draft_len=4)
    drafter.load_history("p", [RESPONSE])
    drafter.start_request("r", "p", [1, 1, 1])
    assert drafter.propose(["r"], [100]) == [RESPONSE[:4]]
    drafter.add_tokens("r", RESPONSE[:2])
    assert drafter.propose(["r"], [100]) == [RESPONSE[2:6]]


def test_first_epoch_without_history_drafts_nothing_then_learns_from_a_sibling():
    """Empty history (first epoch): no draft and no error; once a sibling has generated
    tokens, the other sibling is drafted from them (Seer's grouped drafting)."""
    drafter = _fixed()
    drafter.start_request("a", "p", [1, 1])
    drafter.start_request("b", "p", [1, 1])
    assert drafter.propose(["a", "b"], [100, 100]) == [[], []]
    assert drafter.stats().num_empty_drafts == 2  # counted, not silent
    drafter.add_tokens("a", RESPONSE)
    drafts = drafter.propose(["a", "b"], [100, 100], [EOS, EOS])
    assert drafts[1] == RESPONSE  # b starts where a started, and stops at EOS
    drafter.record_acceptance("b", len(RESPONSE), 3)
    stats = drafter.stats()
    assert (stats.num_requests_asked, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 9, 3)
    drafter.add_tokens("b", RESPONSE[:3])
    assert drafter.propose(["b"], [100], [EOS]) == [RESPONSE[3:]]


def test_siblings_are_invisible_without_use_siblings():
    """use_siblings=False: a request drafts from history and prompt only."""
    drafter = _fixed(use_siblings=False)
    drafter.start_request("a", "p", [1])
    drafter.start_request("b", "p", [1])
    drafter.add_tokens("a", RESPONSE)
    assert drafter.propose(["b"], [100]) == [[]]


def test_prompt_lookup_source():
    """The prompt is a source: a response quoting the prompt is drafted from it."""
    prompt = [40, 41, 42, 43, 44, 45]
    drafter = _fixed(max_draft_len=3)
    drafter.start_request("r", "p", prompt)
    drafter.add_tokens("r", [9, 40, 41])
    assert drafter.propose(["r"], [100]) == [[42, 43, 44]]
    assert _fixed(use_prompt=False).propose is not None


def test_drafts_are_cut_by_max_lens_and_budget():
    """A draft never exceeds max_lens[i]; the batch never exceeds the budget, and the
    budget goes to the longest-matching (highest gain) tokens first."""
    drafter = _fixed()
    drafter.load_history("p", [RESPONSE])
    for rid in "ab":
        drafter.start_request(rid, "p", [1])
    drafter.add_tokens("a", RESPONSE[:5])
    assert [len(d) for d in drafter.propose(["a", "b"], [2, 0])] == [2, 0]
    drafts = drafter.propose(["a", "b"], [100, 100], budget=5)
    assert sum(map(len, drafts)) == 5
    assert drafter.propose(["a", "b"], [100, 100], budget=0) == [[], []]


def test_eviction_keeps_memory_bound_and_drops_oldest_epoch_first():
    """History that does not fit is cut oldest epoch first; live siblings then push out
    the remaining old epochs; the index never exceeds max_tokens_per_prompt."""
    budget = 64
    drafter = _fixed(max_tokens_per_prompt=budget)
    new, old = list(range(100, 120)), list(range(200, 220))
    drafter.load_history("p", [old, new, old], epoch_ages=[1, 0, 2])
    assert drafter.memory_tokens("p") <= int(0.75 * budget)
    drafter.start_request("r", "p", [], ())
    assert drafter.propose(["r"], [3]) == [new[:3]]  # newest epoch kept
    for token in range(300, 340):
        drafter.add_tokens("r", [token])
        assert drafter.memory_tokens("p") <= budget
    drafter.start_request("s", "p", [])
    drafter.add_tokens("s", [300, 301])
    assert drafter.propose(["s"], [3]) == [[302, 303, 304]]  # the tracked index still drafts
    for token in range(300, 400):
        drafter.add_tokens("s", [token])
        assert drafter.memory_tokens("p") <= budget


def test_resume_with_generated_tokens_and_lifecycle_errors():
    """A migrated sample resumes with tokens generated elsewhere; unknown or stopped
    requests raise; a released prompt is freed once its last request stops."""
    drafter = _fixed(max_draft_len=3)
    drafter.load_history("p", [RESPONSE])
    drafter.start_request("r", "p", [1], generated_token_ids=RESPONSE[:4])
    assert drafter.propose(["r"], [100]) == [RESPONSE[4:7]]
    with pytest.raises(ValueError):
        drafter.start_request("r", "p", [1])
    drafter.release_prompt("p")
    assert drafter.has_prompt("p")
    drafter.stop_request("r")
    assert not drafter.has_prompt("p")
    assert drafter.memory_tokens("p") == 0
    with pytest.raises(UnknownRequestError):
        drafter.add_tokens("r", [1])
    with pytest.raises(UnknownRequestError):
        drafter.stop_request("r")


def test_reward_weighting_prefers_the_rewarded_branch():
    """Two earlier responses diverge after a shared prefix; with reward weighting the
    draft follows the one with the higher reward, even when it is the rarer one."""
    good, bad = [5, 6, 7, 30, 31, 32], [5, 6, 7, 40, 41, 42]
    for weighting, expect in ((False, 40), (True, 30)):
        drafter = _fixed(reward_weighting=weighting, reward_temperature=2.0)
        drafter.load_history("p", [good, bad, bad], rewards=[1.0, 0.0, 0.0])
        drafter.start_request("r", "p", [1])
        drafter.add_tokens("r", [5, 6, 7])
        assert drafter.propose(["r"], [100])[0][0] == expect


def test_acceptance_feedback_shortens_drafts_then_recovers():
    """With gain cuts on, a request whose drafts keep being rejected drafts less (maybe
    nothing), and drafts again after some steps without evidence: drafting is never
    switched off for good."""
    drafter = HistoDrafter(DrafterConfig(min_gain=0.3, use_global=False))
    drafter.load_history("p", [list(range(10, 200))] * 3)
    drafter.start_request("r", "p", [1])
    drafter.add_tokens("r", [10, 11])
    before = len(drafter.propose(["r"], [100])[0])
    position = 12
    for _ in range(3):
        drafter.record_acceptance("r", before, 0)
        drafter.add_tokens("r", [position])
        position += 1
        drafter.propose(["r"], [100])
    after = len(drafter.propose(["r"], [100])[0])
    assert after < before
    for _ in range(20):
        drafter.add_tokens("r", [position])
        position += 1
    assert len(drafter.propose(["r"], [100])[0]) >= before


@settings(max_examples=60, deadline=None)
@given(history=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), max_size=4),
       generated=st.lists(st.integers(0, 5), max_size=20),
       stops=st.frozensets(st.integers(0, 5), max_size=2),
       max_len=st.integers(0, 20),
       budget=st.one_of(st.none(), st.integers(0, 10)))
def test_draft_never_passes_a_stop_token_or_max_len(history, generated, stops, max_len, budget):
    """For any history and context: a draft ends at the first stop token it contains,
    is at most max_lens[i] long, and the batch respects the budget."""
    drafter = _fixed(max_draft_len=16, use_global=True)
    drafter.add_global_responses(history[::-1])
    drafter.load_history("p", history)
    drafter.start_request("r", "p", [0, 1, 2], generated)
    drafter.start_request("s", "p", [0, 1, 2])
    drafts = drafter.propose(["r", "s"], [max_len, 20], [stops, stops], budget)
    assert len(drafts[0]) <= max_len
    if budget is not None:
        assert sum(map(len, drafts)) <= budget
    for draft in drafts:
        for token in draft[:-1]:
            assert token not in stops


@settings(max_examples=40, deadline=None)
@given(history=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=25), max_size=5),
       steps=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 16), st.integers(0, 4)),
                      max_size=40),
       budget=st.integers(32, 120))
def test_random_engine_loop_keeps_every_invariant(history, steps, budget):
    """A random engine loop (partial acceptance, substitutions, three siblings, a tiny
    memory bound forcing eviction and freezing, a tiny global index flipping
    generations): no error, drafts within max_lens and stop tokens, memory within the
    bounds."""
    drafter = HistoDrafter(DrafterConfig(max_tokens_per_prompt=budget, global_max_tokens=budget,
                                         max_draft_len=6))
    drafter.load_history("p", history, epoch_ages=list(range(len(history))))
    rids = ["a", "b", "c"]
    for rid in rids:
        drafter.start_request(rid, "p", [0, 1])
    stops = frozenset([4])
    for who, accept, recovered in steps:
        rid = rids[who]
        draft = drafter.propose([rid], [5], [stops])[0]
        assert len(draft) <= 5 and all(t not in stops for t in draft[:-1])
        accepted = min(accept, len(draft))
        drafter.add_tokens(rid, draft[:accepted] + [recovered])
        drafter.record_acceptance(rid, len(draft), accepted)
        assert drafter.memory_tokens("p") <= budget
        if accept == 0:  # as a worker does when a sample finishes
            drafter.add_global_responses([draft + [recovered]])
        assert drafter.global_tokens() <= budget
    for rid in rids:
        drafter.stop_request(rid)
