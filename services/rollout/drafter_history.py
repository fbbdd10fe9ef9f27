"""Which earlier epochs the drafter learns from, and how many prompts it keeps.

When a step brings a prompt the drafter has not loaded for that step, its earlier epochs
(up to ``max_epochs``, never the step itself) are read from the history service in one
round trip and loaded into the drafter, newest first (age 0). An epoch whose rewards do
not match its responses one to one (rewards not reported yet) is loaded with NaN rewards,
so reward weighting treats it as unscored. The drafter keeps the ``max_prompts`` most
recently used prompts; older ones are released. This module knows nothing about gRPC.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

log = logging.getLogger(__name__)

MAX_PROMPTS_IN_DRAFTER = 10_000


class DrafterHistory:
    def __init__(self, drafter, history, call, max_epochs: int = 4, max_prompts: int = MAX_PROMPTS_IN_DRAFTER):
        """drafter: the engine's drafter; history: a history client; call: runs a function
        on the engine's thread (the drafter is not thread-safe) and returns an awaitable
        of it (the worker's: ``EngineLoop.call_deferred(urgent=True)``, behind the next
        forward's launch when the engine is busy)."""
        self.drafter = drafter
        self.history = history
        self.call = call
        self.max_epochs = max_epochs
        self.max_prompts = max_prompts
        self._loaded: OrderedDict[str, str] = OrderedDict()  # prompt_id -> step_id whose history is loaded

    async def load(self, items) -> None:
        """Loads earlier epochs of the items' prompts new to their step (one round trip).
        A failed lookup is logged and skipped: drafting from siblings still works."""
        wanted = {(it.prompt_id, it.step_id) for it in items if self._loaded.get(it.prompt_id) != it.step_id}
        if not wanted:
            return
        prompt_ids = sorted({p for p, _ in wanted})
        try:
            found = await self.history.get_history(prompt_ids, max_epochs=self.max_epochs, include_tokens=True)
        except Exception as exc:  # noqa: BLE001 - drafting from siblings still works
            log.warning("history lookup failed: %s", exc)
            return
        await self.call(lambda: self._apply(wanted, found))

    def _apply(self, wanted: set[tuple[str, str]], found: dict) -> None:
        for prompt_id, step_id in wanted:
            responses, ages, rewards = [], [], []
            for age, epoch in enumerate(e for e in found.get(prompt_id, []) if e.step_id != step_id):
                responses += epoch.responses
                ages += [age] * len(epoch.responses)
                scored = len(epoch.rewards) == len(epoch.responses)
                rewards += list(epoch.rewards) if scored else [float("nan")] * len(epoch.responses)
            self.drafter.load_history(prompt_id, responses, epoch_ages=ages, rewards=rewards)
            self._loaded[prompt_id] = step_id
            self._loaded.move_to_end(prompt_id)
        while len(self._loaded) > self.max_prompts:
            old, _ = self._loaded.popitem(last=False)
            self.drafter.release_prompt(old)
