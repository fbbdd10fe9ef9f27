"""One request's draft from several suffix indexes at once: pure functions, no state.

A source is a suffix index and the request's longest match in it (state, length L):
the prompt's own index (earlier epochs, live siblings, the prompt, the request's own
text) and the generations of the worker's global index. How a draft is made:
1. Each source climbs from its match to the longest context that was continued
   (`prepare`); a source whose context is shorter than `min_match_len` (and not anchored
   at the start of the response) stays silent.
2. Each step, every live source proposes its heaviest next token, and the heaviest
   next token of its next shorter context (a long context seen a few times can be
   outvoted by the many occurrences of its suffix); each candidate is scored by all
   sources together: p(t) = sum_s trust_s * p_s(t) / sum_s trust_s, with
   p_s(t) = weight(t) / (total weight after the context + smoothing), backed off to the
   next shorter context (`_prob`), and trust_s = L_s / (L_s + prior_s), so agreeing
   sources confirm a token, disagreeing ones dilute it, and a long match outweighs a
   short one.
3. The best candidate extends the draft; the draft's gain, the estimated chance that
   the whole prefix is accepted (starting at the most trusted source's trust), is
   multiplied by min(0.99, p * calibration). The draft stops when the gain drops below
   `min_gain` (the caller's cost threshold included), at `cap`, or after a stop token.
4. Every source follows the chosen token; one that cannot backs off to shorter contexts
   (suffix links, not below `min_match_len`) or falls silent.

`steps` is the engine's hot path, written out for speed (lookups inlined, one pass over
the sources per token); tests/rollout/drafter/reference_walk.py keeps the plain version,
and test_drafter_reference.py holds this one to it, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.rollout.drafter.suffix_index import SuffixIndex

# A live source during a walk: [index, state, match length, prior].
Source = list


def prepare(index: SuffixIndex, state: int, match_len: int, prior: float, min_match_len: int,
            anchored_len: int) -> Source | None:
    """The source for a request whose longest match in `index` is (state, match_len),
    climbed to a context that was continued; None if it has nothing to say.

    `anchored_len`: the request's text length; a match that long starts at the response's
    start marker and counts whatever its length."""
    one_next, trans, link, length = index.one_next, index.trans, index.link, index.length
    while state > 0 and match_len <= length[link[state]]:  # index.settle, inlined
        state = link[state]
    while state > 0 and not one_next[state] and trans[state] is None:
        state = link[state]  # climb to a context that was continued
        match_len = length[state]
    if state <= 0 or (match_len < min_match_len and match_len != anchored_len):
        return None
    return [index, state, match_len, prior]


def _scan(index: SuffixIndex, state: int) -> tuple[int, int, float, float]:
    """(token, next state, its weight, total weight) of the heaviest continuation of a
    state with two or more (the first of equal weights, in the dict's order)."""
    weight = index.weight
    total, best, token, best_state = 0.0, -1.0, 0, 0
    for tok, st in index.trans[state].items():
        w = weight[st]
        total += w
        if w > best:
            best, token, best_state = w, tok, st
    return token, best_state, best, total


def _prob(index: SuffixIndex, state: int, token: int, smoothing: float, backoff: float) -> float:
    """The source's estimate p(token | context), backed off to the next shorter context
    (Witten-Bell style): the longer the list of different tokens seen after the context,
    the more its estimate leans on the shorter one's. A long but rare context ("= 1"
    after one specific digit string) would otherwise promise a digit the policy samples
    anew every time. `state` was continued: it has one transition or a dict. `steps`
    inlines the same for the token each source proposes itself."""
    one_next, one_token, weight = index.one_next, index.one_token, index.weight
    parent = index.link[state]
    up = one_next[parent]
    if up:
        if one_token[parent] != token:
            up = 0
    else:
        edges = index.trans[parent]
        up = edges.get(token, 0) if edges is not None else 0
    single = one_next[state]
    if single:
        nxt = single if one_token[state] == token else 0
        if not nxt and not up:
            return 0.0
        total = weight[single]
        escape = backoff * 1 + smoothing
    else:
        edges = index.trans[state]
        nxt = edges.get(token, 0)
        if not nxt and not up:
            return 0.0
        # sum(), as ever: from Python 3.12 on it rounds differently from a running total
        total = sum(map(weight.__getitem__, edges.values()))
        escape = backoff * len(edges) + smoothing
    w = weight[nxt] if nxt else 0.0
    if parent <= 0:
        return w / (total + smoothing)
    return ((w + escape * (weight[up] / (weight[parent] + smoothing))) if up else w) / (total + escape)


def _follow(source: Source, token: int, nxt: int | None, min_match_len: int) -> bool:
    """Moves the source past `token` (`nxt`: its transition on it, if known); False when
    it cannot (it falls silent)."""
    index, state = source[0], source[1]
    one_next, trans = index.one_next, index.trans
    if nxt is None:
        nxt = index.get(state, token)
        if nxt is None:
            link, length, get = index.link, index.length, index.get
            while nxt is None and length[link[state]] >= min_match_len:
                state = link[state]
                source[2] = length[state]
                nxt = get(state, token)
            if nxt is None:
                return False
    if one_next[nxt] or trans[nxt] is not None:
        source[1] = nxt
        source[2] += 1
        return True
    link, length = index.link, index.length  # a dead end: back off
    state = nxt
    while length[link[state]] >= min_match_len:
        state = link[state]
        if one_next[state] or trans[state] is not None:
            source[1], source[2] = state, length[state]
            return True
    return False


def initial_gain(sources: list[Source]) -> float:
    """The gain a draft starts from: the most trusted source's trust. No token of the
    draft has a higher gain (each multiplies it by at most 0.99)."""
    return max(s[2] / (s[2] + s[3]) for s in sources)


def steps(sources: list[Source], gain: float, cap: int, stops: frozenset[int], smoothing: float, backoff: float,
          min_match_len: int, min_gain: float, calibration: float) -> Iterator[tuple[int, float]]:
    """The draft (at most `cap` tokens), token by token with its gain (non-increasing),
    computed as it is asked for, from (non-empty) sources whose `initial_gain` is `gain`.

    Hot path (every request, every step): one pass over the sources reads each one's
    heaviest continuation, its back-off candidate and its own estimate of that token
    (`_prob`'s, inlined); candidates are scored only when the sources disagree."""
    if cap <= 0:
        return
    num_tokens = 0
    single_escape = backoff * 1 + smoothing  # the escape weight of a one-transition context
    while num_tokens < cap and sources:
        views = []  # per source: (token, next state, own estimate of the token)
        backoffs = []
        token = None
        agree = True
        for s in sources:
            index, state = s[0], s[1]
            one_next, one_token, weight = index.one_next, index.one_token, index.weight
            nxt = one_next[state]
            if nxt:
                tok = one_token[state]
                w = total = weight[nxt]
                escape = single_escape
            else:
                tok, nxt, w, total = _scan(index, state)
                escape = backoff * len(index.trans[state]) + smoothing
            parent = index.link[state]
            if parent <= 0:
                own = w / (total + smoothing)
            else:
                up = one_next[parent]
                if up:
                    if index.length[parent] >= min_match_len:
                        backoffs.append(one_token[parent])
                    if one_token[parent] != tok:
                        up = 0
                else:
                    edges = index.trans[parent]
                    if edges is not None:
                        if index.length[parent] >= min_match_len:
                            backoffs.append(_scan(index, parent)[0])
                        up = edges.get(tok, 0)
                own = ((w + escape * (weight[up] / (weight[parent] + smoothing))) if up else w) / (total + escape)
            views.append((tok, nxt, own))
            if token is None:
                token = tok
            elif tok != token:
                agree = False
        if agree:
            for b in backoffs:
                if b != token:
                    agree = False
                    break
        if agree:  # every source and back-off proposes the same token
            if len(sources) == 1:  # one source, one opinion: its own estimate
                p = views[0][2]
            else:
                trusts = [s[2] / (s[2] + s[3]) for s in sources]
                score = 0.0
                for v, trust in zip(views, trusts):
                    score += trust * v[2]
                p = score / sum(trusts)
        else:
            candidates = {v[0] for v in views}
            candidates.update(backoffs)
            trusts = [s[2] / (s[2] + s[3]) for s in sources]
            p, token = -1.0, 0
            for cand in candidates:
                score = 0.0
                for s, v, trust in zip(sources, views, trusts):
                    score += trust * (v[2] if v[0] == cand else _prob(s[0], s[1], cand, smoothing, backoff))
                if score > p:
                    p, token = score, cand
            p /= sum(trusts)
        q = p * calibration
        gain *= q if q < 0.99 else 0.99
        if gain < min_gain:
            return
        yield token, gain
        num_tokens += 1
        if token in stops:
            return
        followed = []
        for s, v in zip(sources, views):
            if v[0] != token:
                if _follow(s, token, None, min_match_len):
                    followed.append(s)
                continue
            index, nxt = s[0], v[1]
            if index.one_next[nxt] or index.trans[nxt] is not None:  # `_follow`'s common case
                s[1] = nxt
                s[2] += 1
                followed.append(s)
            elif _follow(s, token, nxt, min_match_len):
                followed.append(s)
        sources = followed
