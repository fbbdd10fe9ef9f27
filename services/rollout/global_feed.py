"""What feeds a worker's global draft index (HistoDrafter.add_global_responses).

A worker sees only the prompts the scheduler sends it, yet its drafter gains from
every prompt's responses (one task family shares phrasing). Two feeds:
1. Its own samples, as each finishes here (stop or length): the fullest, freshest view
   of the step, at no network cost.
2. At the start of each step, the history service's stream of the most recent responses
   to any prompt (GetRecentResponses): what the other workers produced, which the
   scheduler stored as their samples finished.
A response is added once, whichever feed brings it first (keyed by prompt, step, sample).
The drafter runs on the engine thread, so responses reach it through `EngineLoop.call`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict

log = logging.getLogger(__name__)
_MAX_KEYS = 1 << 16  # responses remembered as already added


class GlobalFeed:
    """Feeds `drafter.add_global_responses` from finished samples and the history stream.

    Args:
        loop: the worker's EngineLoop (runs the drafter's calls on the engine thread).
        drafter: the engine's drafter; it must have `add_global_responses`.
        history: a HistoryClient, or None (then only the worker's own samples).
        max_responses, max_tokens: how much of the stream to read at each step start.
    """

    def __init__(self, loop, drafter, history=None, max_responses: int = 512, max_tokens: int = 131072):
        self.loop = loop
        self.drafter = drafter
        self.history = history
        self.max_responses = max_responses
        self.max_tokens = max_tokens
        self._seen: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self._steps: OrderedDict[str, None] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()
        self.num_added = 0

    def _is_new(self, key: tuple[str, str, int]) -> bool:
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > _MAX_KEYS:
            self._seen.popitem(last=False)
        return True

    def finished(self, prompt_id: str, step_id: str, sample_index: int, token_ids: list[int]) -> None:
        """A sample finished on this worker; adds it without waiting (between two steps)."""
        if not token_ids or not self._is_new((prompt_id, step_id, sample_index)):
            return
        task = asyncio.get_running_loop().create_task(self._add([token_ids]))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def step_started(self, step_ids: set[str]) -> None:
        """Reads the history stream once per new step id (a failed read only costs drafts)."""
        new = [s for s in step_ids if s not in self._steps]
        if not new or self.history is None or self.max_responses <= 0:
            return
        for step_id in new:
            self._steps[step_id] = None
        while len(self._steps) > 1024:
            self._steps.popitem(last=False)
        try:
            recent = await self.history.get_recent_responses(self.max_responses, self.max_tokens)
        except Exception as exc:  # noqa: BLE001 - drafting from this worker's own samples still works
            log.warning("recent responses lookup failed: %s", exc)
            return
        fresh = [r.token_ids for r in reversed(recent)  # oldest first: the newest stay longest
                 if len(r.token_ids) and self._is_new((r.prompt_id, r.step_id, r.sample_index))]
        if fresh:
            await self._add(fresh)

    async def _add(self, responses: list) -> None:
        try:
            await self.loop.call(lambda: self.drafter.add_global_responses(responses))
            self.num_added += len(responses)
        except Exception:  # noqa: BLE001 - a drafter bug costs drafts, never samples
            log.exception("adding %d responses to the global draft index failed", len(responses))
