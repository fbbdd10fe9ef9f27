"""The drafter's walk and budget cut as they were written before the hot path was
optimized (one draft at a time, whole; then `trim_to_budget`): a plain reference that
test_drafter_reference.py holds the optimized code to, draft for draft and gain for gain.
Slow on purpose: every step is a small function, as readable as the algorithm."""

from __future__ import annotations

from services.rollout.drafter import HistoDrafter, UnknownRequestError, trim_to_budget
from services.rollout.drafter.budget import gain_threshold
from services.rollout.drafter.suffix_index import SuffixIndex
from services.rollout.drafter.walk import Source


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


class ReferenceDrafter(HistoDrafter):
    """HistoDrafter with the reference walk: each request drafted whole, in batch
    order, then cut to the budget."""

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None, num_seqs=None):
        cfg = self.config
        if stop_token_ids is None:
            stop_token_ids = [frozenset()] * len(request_ids)
        min_gain = cfg.min_gain
        if cfg.cost_model is not None:
            min_gain = max(min_gain, gain_threshold(cfg.cost_model, num_seqs or len(request_ids),
                                                    self._draft_per_seq, self._gain_per_seq))
        drafts, all_gains = [], []
        for request_id, max_len, stops in zip(request_ids, max_lens, stop_token_ids, strict=True):
            request = self._requests.get(request_id)
            if request is None:
                raise UnknownRequestError(request_id)
            tokens, gains = self._reference_draft(request, min(max_len, cfg.max_draft_len), stops, min_gain)
            drafts.append(tokens)
            all_gains.append(gains)
        if budget is not None:
            trim_to_budget(drafts, all_gains, max(0, budget))
        self._account([self._requests[r] for r in request_ids], drafts, all_gains)
        return drafts

    def _reference_draft(self, request, cap, stops, min_gain):
        cfg = self.config
        if cap <= 0:
            return [], []
        sources = request.sources(self._prompts[request.prompt_id].index, self._global, cfg)
        request.calibration_used = calibration = request.calibration
        return draft(sources, cap, stops, cfg.smoothing, cfg.backoff_weight, cfg.min_match_len, min_gain,
                     calibration)
