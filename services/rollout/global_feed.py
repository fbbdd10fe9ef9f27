"""What feeds a worker's global draft index (HistoDrafter.add_global_responses).

A worker sees only the prompts the scheduler sends it, yet its drafter gains from
every prompt's responses (one task family shares phrasing). Two feeds:
1. Its own samples, as each finishes here (stop or length): the fullest, freshest view
   of the step, at no network cost.
2. At the start of each step, the history service's stream of the most recent responses
   to any prompt (GetRecentResponses): what the other workers produced, which the
   scheduler stored as their samples finished.
The stream is read before the step's items go to the engine, so the read goes through the
worker's ``HistoryBreaker`` (shared with ``drafter_history.py``): at most its deadline, and
skipped for a while after a history read timed out (a hung history must not hold steps up).
A response is added once, whichever feed brings it first (keyed by prompt, step, sample).
The drafter runs on the engine thread, so responses reach it through
`EngineLoop.call_deferred`, in chunks of at most `chunk_tokens` tokens (a longer response
is a chunk alone): at once while the engine has no work, else behind its forwards, a few
chunks a step (`LLMEngine.defer`: the inserts cost under a microsecond a token, and a
step's stream is up to 131,072 tokens). Nothing waits for them: a step's items go to the
engine as soon as the stream is read, and its first drafts see whatever has landed.
The backlog is bounded: past ``max_backlog_tokens`` (the index's own capacity,
``DrafterConfig.global_max_tokens``: an index that keeps only its newest tokens would
drop the older ones at once) the oldest chunks not inserted yet are dropped.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from functools import partial

from services.common import metrics
from services.history.breaker import HistoryBreaker
from services.rollout.drafter_history import MAX_TOKEN_ID, first_bad_token

log = logging.getLogger(__name__)
_MAX_KEYS = 1 << 16  # responses remembered as already added


class GlobalFeed:
    """Feeds `drafter.add_global_responses` from finished samples and the history stream.

    Args:
        loop: the worker's EngineLoop (runs the drafter's calls on the engine thread).
        drafter: the engine's drafter; it must have `add_global_responses`.
        history: a HistoryClient, or None (then only the worker's own samples).
        max_responses, max_tokens: how much of the stream to read at each step start.
        chunk_tokens: the most tokens handed to the drafter in one call (the engine
            paces the calls by their tokens).
        max_backlog_tokens: the most tokens handed over and not inserted yet (None: the
            drafter's ``config.global_max_tokens``, else 2^20).
        worker_id: labels its series (``drafter_feed_responses``, ``drafter_feed_pending``).
        breaker: bounds the stream's reads (the worker's, shared with its drafter history;
            None: one of its own, default deadline).
    """

    def __init__(self, loop, drafter, history=None, max_responses: int = 512, max_tokens: int = 131072,
                 chunk_tokens: int = 1024, max_backlog_tokens: int | None = None, worker_id: str = "local",
                 breaker: HistoryBreaker | None = None):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: {chunk_tokens} < 1")
        if max_backlog_tokens is None:
            max_backlog_tokens = getattr(getattr(drafter, "config", None), "global_max_tokens", 1 << 20)
        if max_backlog_tokens < 1:
            raise ValueError(f"max_backlog_tokens: {max_backlog_tokens} < 1")
        self.loop = loop
        self.drafter = drafter
        self.history = history
        self.breaker = breaker if breaker is not None else HistoryBreaker(name="worker")
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self.chunk_tokens = chunk_tokens
        self.max_backlog_tokens = max_backlog_tokens
        self._backlog: deque[_Chunk] = deque()  # handed over, oldest first (landed ones leave from the left)
        self._backlog_tokens = 0
        self.num_dropped = 0  # responses dropped from the backlog unread
        self._seen: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self._steps: OrderedDict[str, None] = OrderedDict()
        self.num_added = 0
        self.num_pending = 0  # responses handed to the engine thread, not in the index yet
        self._added_series = metrics.drafter_feed_responses.labels(worker_id)
        self._pending_series = metrics.drafter_feed_pending.labels(worker_id)

    def _is_new(self, key: tuple[str, str, int]) -> bool:
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > _MAX_KEYS:
            self._seen.popitem(last=False)
        return True

    def finished(self, prompt_id: str, step_id: str, sample_index: int, token_ids: list[int]) -> None:
        """A sample finished on this worker; adds it without waiting."""
        if not token_ids or not self._is_new((prompt_id, step_id, sample_index)):
            return
        self._add([token_ids])

    async def step_started(self, step_ids: set[str]) -> None:
        """Reads the history stream once per new step id (a failed, timed-out or skipped
        read only costs drafts) and hands its new responses over, without waiting for
        them to land."""
        new = [s for s in step_ids if s not in self._steps]
        if not new or self.history is None or self.max_responses <= 0:
            return
        for step_id in new:
            self._steps[step_id] = None
        while len(self._steps) > 1024:
            self._steps.popitem(last=False)
        try:
            recent = await self.breaker.read(
                lambda: self.history.get_recent_responses(self.max_responses, self.max_tokens),
                "recent responses lookup")
        except Exception as exc:  # noqa: BLE001 - drafting from this worker's own samples still works
            log.debug("steps %s start without history's recent responses: %s", new, exc)  # (the breaker warns)
            return
        fresh = [r.token_ids for r in reversed(recent)  # oldest first: the newest stay longest
                 if len(r.token_ids) and self._is_new((r.prompt_id, r.step_id, r.sample_index))]
        if fresh:
            self._add(fresh)

    def _add(self, responses: list) -> None:
        """Hands ``responses`` (oldest first) to the drafter in chunks (the module
        docstring); each is counted, or its failure logged, when it lands. Past the
        backlog's bound, the oldest chunks still waiting are dropped."""
        for responses_, num_tokens in chunks(responses, self.chunk_tokens):
            chunk = _Chunk(responses_, num_tokens)
            self._backlog.append(chunk)
            self._backlog_tokens += num_tokens
            self.num_pending += len(responses_)
            future = self.loop.call_deferred(partial(self._insert, chunk), num_tokens)
            future.add_done_callback(partial(self._landed, chunk))
        while self._backlog_tokens > self.max_backlog_tokens and len(self._backlog) > 1:
            chunk = self._backlog.popleft()
            if not chunk.landed:  # (a landed one left the counts when it landed)
                chunk.dropped = True
                self._leave(chunk)
                self.num_dropped += len(chunk.responses)
        self._pending_series.set(self.num_pending)

    def _insert(self, chunk: _Chunk) -> None:
        """On the engine thread: the chunk into the index, unless dropped meanwhile. If the
        drafter refuses it, its responses with a token id it cannot take (stored unchecked
        by older history services) are skipped with one WARNING and the rest added."""
        if chunk.dropped:
            return
        try:
            self.drafter.add_global_responses(chunk.responses)
            return
        except ValueError:
            bad = [n for n, r in enumerate(chunk.responses) if first_bad_token(r) is not None]
            if not bad:
                raise  # not the responses' fault: a drafter bug, logged when the chunk lands
        skip = set(bad)
        chunk.num_skipped = len(bad)
        log.warning("global draft index: skipped %d of %d streamed responses with a token id out of range "
                    "[0, %d] (first: %d)", len(bad), len(chunk.responses), MAX_TOKEN_ID,
                    first_bad_token(chunk.responses[bad[0]]))
        kept = [r for n, r in enumerate(chunk.responses) if n not in skip]
        if kept:
            self.drafter.add_global_responses(kept)

    def _leave(self, chunk: _Chunk) -> None:
        """The chunk's responses and tokens out of the backlog's counts (landed or dropped)."""
        self._backlog_tokens -= chunk.num_tokens
        self.num_pending -= len(chunk.responses)

    def _landed(self, chunk: _Chunk, future) -> None:
        if not chunk.dropped:  # (a dropped one left the counts when it was dropped)
            chunk.landed = True
            self._leave(chunk)
        while self._backlog and self._backlog[0].landed:
            self._backlog.popleft()
        self._pending_series.set(self.num_pending)
        if future.cancelled() or chunk.dropped:
            return
        if future.exception() is not None:  # a drafter bug costs drafts, never samples
            log.error("adding %d responses to the global draft index failed", len(chunk.responses),
                      exc_info=future.exception())
            return
        num_added = len(chunk.responses) - chunk.num_skipped
        self.num_added += num_added
        self._added_series.inc(num_added)


class _Chunk:
    """Responses handed to the drafter in one call, while in the feed's backlog."""

    __slots__ = ("responses", "num_tokens", "dropped", "landed", "num_skipped")

    def __init__(self, responses: list, num_tokens: int):
        self.responses, self.num_tokens = responses, num_tokens
        self.dropped = False  # read by the engine thread: skip the insert
        self.landed = False
        self.num_skipped = 0  # responses the drafter refused (set by the engine thread before it lands)


def chunks(responses: list, most: int) -> list[tuple[list, int]]:
    """``responses`` in order, cut into runs of at most ``most`` tokens (a longer
    response alone), each with its token count."""
    out: list[tuple[list, int]] = []
    run: list = []
    tokens = 0
    for r in responses:
        n = len(r)
        if run and tokens + n > most:
            out.append((run, tokens))
            run, tokens = [], 0
        run.append(r)
        tokens += n
    if run:
        out.append((run, tokens))
    return out
