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
   next shorter context (`_blend`), and trust_s = L_s / (L_s + prior_s), so agreeing
   sources confirm a token, disagreeing ones dilute it, and a long match outweighs a
   short one.
3. The best candidate extends the draft; the draft's gain, the estimated chance that
   the whole prefix is accepted (starting at the most trusted source's trust), is
   multiplied by min(0.99, p * calibration). The draft stops when the gain drops below
   `min_gain` (the caller's cost threshold included), at `cap`, or after a stop token.
4. Every source follows the chosen token; one that cannot backs off to shorter contexts
   (suffix links, not below `min_match_len`) or falls silent.
"""

from __future__ import annotations

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


def _best(index: SuffixIndex, state: int) -> tuple[int, int, float, float]:
    """(token, next state, its weight, total weight) of the heaviest continuation."""
    nxt = index.one_next[state]
    if nxt:
        w = index.weight[nxt]
        return index.one_token[state], nxt, w, w
    total, best, token, best_state = 0.0, -1.0, 0, 0
    for tok, st in index.trans[state].items():
        w = index.weight[st]
        total += w
        if w > best:
            best, token, best_state = w, tok, st
    return token, best_state, best, total


def _blend(index: SuffixIndex, state: int, token: int, w: float, total: float, smoothing: float,
           backoff: float) -> float:
    """p(token | context) backed off to the next shorter context (Witten-Bell style): the
    longer the list of different tokens seen after the context, the more its estimate
    leans on the shorter one's. A long but rare context ("= 1" after one specific digit
    string) would otherwise promise a digit the policy samples anew every time."""
    parent = index.link[state]
    escape = backoff * (1 if index.one_next[state] else len(index.trans[state])) + smoothing
    if parent <= 0:
        return w / (total + smoothing)
    nxt = index.get(parent, token)
    # the parent's occurrences (its weight) stand for its continuations' total: O(1)
    lower = index.weight[nxt] / (index.weight[parent] + smoothing) if nxt is not None else 0.0
    return (w + escape * lower) / (total + escape)


def _prob(index: SuffixIndex, state: int, token: int, smoothing: float, backoff: float) -> float:
    """The source's estimate of a token it did not propose itself."""
    nxt = index.get(state, token)
    if nxt is None and index.get(index.link[state], token) is None:
        return 0.0
    total = index.weight[index.one_next[state]] if index.one_next[state] else sum(
        index.weight[st] for st in index.trans[state].values())
    return _blend(index, state, token, index.weight[nxt] if nxt is not None else 0.0, total, smoothing, backoff)


def _follow(source: Source, token: int, nxt: int | None, min_match_len: int) -> bool:
    """Moves the source past `token`; False when it cannot (it falls silent)."""
    index, state, match_len = source[0], source[1], source[2]
    if nxt is None:
        link, length, get = index.link, index.length, index.get
        while nxt is None and length[link[state]] >= min_match_len:
            state = link[state]
            match_len = length[state]
            nxt = get(state, token)
        if nxt is None:
            return False
    if not index.one_next[nxt] and index.trans[nxt] is None:  # a dead end: back off
        link, length = index.link, index.length
        state, match_len = nxt, match_len + 1
        while length[link[state]] >= min_match_len:
            state = link[state]
            match_len = length[state]
            if index.one_next[state] or index.trans[state] is not None:
                source[1], source[2] = state, match_len
                return True
        return False
    source[1], source[2] = nxt, match_len + 1
    return True


def draft(sources: list[Source], cap: int, stops: frozenset[int], smoothing: float, backoff: float,
          min_match_len: int, min_gain: float, calibration: float) -> tuple[list[int], list[float]]:
    """The draft (at most `cap` tokens) and each token's gain (non-increasing)."""
    tokens: list[int] = []
    gains: list[float] = []
    if not sources or cap <= 0:
        return tokens, gains
    gain = max(s[2] / (s[2] + s[3]) for s in sources)
    while len(tokens) < cap and sources:
        views = [_best(s[0], s[1]) for s in sources]  # (token, next, w, total) each
        candidates = {v[0] for v in views}
        for s in sources:  # what the next shorter context would say (step 2's back-off)
            index, parent = s[0], s[0].link[s[1]]
            if parent > 0 and index.length[parent] >= min_match_len and (
                    index.one_next[parent] or index.trans[parent] is not None):
                candidates.add(_best(index, parent)[0])
        if len(candidates) == 1 and len(sources) == 1:  # one source, one opinion: its own estimate
            index, state = sources[0][0], sources[0][1]
            token, nxt, w, total = views[0]
            p = _blend(index, state, token, w, total, smoothing, backoff)
            chosen_next = [nxt]
        else:
            trusts = [s[2] / (s[2] + s[3]) for s in sources]
            p, token = -1.0, 0
            for cand in candidates:
                score = 0.0
                for s, (tok, _, w, total), trust in zip(sources, views, trusts):
                    score += trust * (_blend(s[0], s[1], tok, w, total, smoothing, backoff) if tok == cand
                                      else _prob(s[0], s[1], cand, smoothing, backoff))
                if score > p:
                    p, token = score, cand
            p /= sum(trusts)
            chosen_next = [v[1] if v[0] == token else None for v in views]
        q = p * calibration
        gain *= q if q < 0.99 else 0.99
        if gain < min_gain:
            break
        tokens.append(token)
        gains.append(gain)
        if token in stops:
            break
        sources = [s for s, nxt in zip(sources, chosen_next)
                   if _follow(s, token, nxt if nxt is not None else s[0].get(s[1], token), min_match_len)]
    return tokens, gains
