"""Drafter v2's three sources: the prompt's own index, live siblings, the global index.

If these fail, a draft proposes text no source ever contained (wasted verify work), a
missing source (first epoch, a lone sample, an empty global index) stops drafting
altogether, or the global index grows without bound or forgets the newest responses."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.drafter import DrafterConfig, GlobalIndex, HistoDrafter
from services.rollout.drafter.prompt_index import START

tokens = st.lists(st.integers(0, 5), min_size=1, max_size=25)


def _pairs(texts: list[list[int]]) -> set[tuple[int, int]]:
    return {(a, b) for t in texts for a, b in zip(t, t[1:])}


@settings(max_examples=80, deadline=None)
@given(history=st.lists(tokens, max_size=3), sibling=st.lists(st.integers(0, 5), max_size=20),
       others=st.lists(tokens, max_size=3), prompt=tokens, generated=st.lists(st.integers(0, 5), max_size=20))
def test_every_draft_step_continues_text_some_source_contains(history, sibling, others, prompt, generated):
    """Each draft token follows its predecessor (the context's last token for the first)
    somewhere in a source: an earlier response, a sibling, another prompt's response,
    the prompt, or the request's own text. Drafts are continuations, never inventions."""
    drafter = HistoDrafter(DrafterConfig(min_gain=0.0, min_match_len=1))
    drafter.load_history("p", history)
    drafter.add_global_responses(others)
    drafter.start_request("s", "p", prompt, sibling)
    drafter.start_request("r", "p", prompt, generated)
    draft = drafter.propose(["r"], [16])[0]
    own = [START, *generated]
    sources = [[START, *h] for h in history] + [[START, *sibling]] + [[START, *o] for o in others]
    known = _pairs(sources + [prompt, own])
    for prev, token in zip([own[-1], *draft], draft):
        assert (prev, token) in known


RESPONSE = [5, 6, 7, 8, 9, 10, 11, 12]


def test_each_source_alone_still_drafts():
    """First epoch, a lone sample, an empty global index: whichever sources are empty,
    the others still draft the continuation they know."""
    alone = {
        "history": dict(use_siblings=False, use_prompt=False, use_global=False),
        "siblings": dict(use_history=False, use_prompt=False, use_global=False),
        "global": dict(use_history=False, use_siblings=False, use_prompt=False),
        "prompt": dict(use_history=False, use_siblings=False, use_global=False),
    }
    for source, flags in alone.items():
        drafter = HistoDrafter(DrafterConfig(min_gain=0.0, max_draft_len=3, **flags))
        drafter.load_history("p", [RESPONSE] if source == "history" else [])
        drafter.add_global_responses([RESPONSE] if source == "global" else [])
        prompt = [1, *RESPONSE] if source == "prompt" else [1]
        if source == "siblings":
            drafter.start_request("s", "p", prompt, RESPONSE)
        drafter.start_request("r", "p", prompt, RESPONSE[:3])
        assert drafter.propose(["r"], [100]) == [RESPONSE[3:6]], source


def test_global_index_drafts_a_prompt_seen_nowhere_else():
    """A new prompt (no history, no siblings) is drafted from another prompt's response
    that shares its phrasing, and not when the global index is off."""
    for use_global in (True, False):
        drafter = HistoDrafter(DrafterConfig(min_gain=0.0, max_draft_len=4, use_global=use_global))
        drafter.add_global_responses([[40, 41, 42, 43, 44, 45, 46]])
        drafter.start_request("r", "new-prompt", [1], [40, 41])
        assert drafter.propose(["r"], [100]) == ([[42, 43, 44, 45]] if use_global else [[]])


@settings(max_examples=30, deadline=None)
@given(responses=st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=40), min_size=1, max_size=60),
       bound=st.integers(16, 200))
def test_global_index_stays_under_its_bound(responses, bound):
    """However many responses arrive, the global index holds at most its bound."""
    index = GlobalIndex(bound, START)
    for r in responses:
        index.add(r)
        assert index.num_tokens <= bound


def test_global_eviction_keeps_the_newest():
    """Past the bound, the oldest responses go first; the newest stay draftable, and a
    request's tracker follows the index across generation flips."""
    drafter = HistoDrafter(DrafterConfig(min_gain=0.0, max_draft_len=3, global_max_tokens=64,
                                         use_history=False, use_siblings=False, use_prompt=False))
    drafter.add_global_responses([[100, 101, 102, 103, 104]])
    drafter.start_request("old", "p", [1], [100, 101])
    assert drafter.propose(["old"], [9]) == [[102, 103, 104]]
    for i in range(20):  # filler: flips the generations twice
        drafter.add_global_responses([[200 + i] * 7])
    drafter.add_global_responses([[300, 301, 302, 303, 304]])
    assert drafter.global_tokens() <= 64
    drafter.add_tokens("old", [102])  # its tracker catches up with the new generations
    assert drafter.propose(["old"], [9]) == [[]]  # forgotten
    drafter.start_request("new", "q", [1], [300, 301])
    assert drafter.propose(["new"], [9]) == [[302, 303, 304]]


def test_running_requests_of_other_prompts_draft_before_they_finish():
    """Another prompt's request running on this worker is drafted from as soon as its
    tokens are committed (the step's own phrasing), not only once it finishes."""
    drafter = HistoDrafter(DrafterConfig(min_gain=0.0, max_draft_len=3, use_history=False,
                                         use_siblings=False, use_prompt=False))
    drafter.start_request("other", "q", [1], [50, 51])
    drafter.add_tokens("other", [52, 53, 54])
    drafter.start_request("r", "p", [1], [51, 52])
    assert drafter.propose(["r"], [100]) == [[53, 54]]


def test_a_finished_response_indexed_as_it_ran_is_not_indexed_twice():
    """The worker adds each finished sample to the global index; one that ran here was
    indexed token by token already, so adding it changes nothing, while a response from
    elsewhere (the history stream) is indexed."""
    drafter = HistoDrafter(DrafterConfig(min_gain=0.0, use_history=False, use_siblings=False, use_prompt=False))
    drafter.start_request("a", "p", [1], [60, 61])
    drafter.add_tokens("a", [62, 63])
    drafter.stop_request("a")
    before = drafter.global_tokens()
    drafter.add_global_responses([[60, 61, 62, 63]])
    assert drafter.global_tokens() == before
    drafter.add_global_responses([[60, 61, 62, 63]])  # the same text again, from elsewhere
    assert drafter.global_tokens() == before + 5


def test_a_finished_response_gets_only_the_tokens_the_engine_never_handed_over():
    """The engine stops a request without handing the drafter its last step's tokens:
    when the finished response is added, only that tail is indexed, after its text, so
    the way it ended is draftable and nothing is indexed twice."""
    drafter = HistoDrafter(DrafterConfig(min_gain=0.0, max_draft_len=3, use_history=False,
                                         use_siblings=False, use_prompt=False))
    drafter.start_request("a", "p", [1], [70, 71])
    drafter.add_tokens("a", [72, 73])
    drafter.stop_request("a")  # its last step committed 74, 2 (EOS), never passed on
    before = drafter.global_tokens()
    drafter.add_global_responses([[70, 71, 72, 73, 74, 2]])
    assert drafter.global_tokens() == before + 2
    drafter.start_request("b", "q", [1], [72, 73])
    assert drafter.propose(["b"], [100]) == [[74, 2]]


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(0, 9), min_size=1, max_size=9)),
                    min_size=1, max_size=80),
       bound=st.integers(16, 120))
def test_global_bound_holds_and_keeps_the_newest_with_running_requests(ops, bound):
    """Running requests indexed token by token, finished ones and streamed responses:
    the global index never passes its bound, and the text a request just committed is
    still there (a fresh request continuing it is drafted its next token)."""
    drafter = HistoDrafter(DrafterConfig(min_gain=0.0, max_draft_len=1, global_max_tokens=bound,
                                         use_history=False, use_siblings=False, use_prompt=False,
                                         min_match_len=1))
    running: set[str] = set()
    for n, (op, toks) in enumerate(ops):
        rid = f"r{op}"
        if rid in running and n % 5 == 4:
            drafter.stop_request(rid)
            running.discard(rid)
        elif rid in running:
            drafter.add_tokens(rid, toks)
        elif op == 3:
            drafter.add_global_responses([toks])
        else:
            drafter.start_request(rid, f"p{op}", [1], toks)
            running.add(rid)
        assert drafter.global_tokens() <= bound
    drafter.start_request("last", "z", [1], [100, 101, 102])
    drafter.add_tokens("last", [103])
    drafter.start_request("probe", "y", [1], [102])
    assert drafter.propose(["probe"], [9]) == [[103]]
    assert drafter.global_tokens() <= bound


def test_a_shorter_context_seen_often_outvotes_a_rare_longer_one():
    """After "... 30 31 32" the longest context was followed once by 40, while "31 32"
    was followed by 41 ten times: the walk backs off and drafts 41."""
    drafter = HistoDrafter(DrafterConfig(min_gain=0.0, max_draft_len=1, use_global=False))
    drafter.load_history("p", [[9, 30, 31, 32, 40]] + [[9, 33, 31, 32, 41]] * 10)
    drafter.start_request("r", "p", [1], [30, 31, 32])
    assert drafter.propose(["r"], [100]) == [[41]]
