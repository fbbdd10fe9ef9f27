"""Which earlier epochs the drafter learns from, and how many prompts it keeps.

When a step brings a prompt the drafter has not loaded for that step, its earlier epochs
(up to ``max_epochs``, never the step itself) are read from the history service in one
round trip and loaded into the drafter, newest first (age 0). An epoch whose rewards do
not match its responses one to one (rewards not reported yet) is loaded with NaN rewards,
so reward weighting treats it as unscored. The drafter keeps the ``max_prompts`` most
recently used prompts, and at most ``max_tokens`` tokens of earlier epochs over all of them
(each prompt's counted up to the drafter's ``max_tokens_per_prompt``, what its index holds);
the least recently used are released past either. The count alone let a worker's drafter
grow to 10,000 prompts at their cap, some 65 GB at about 100 bytes an indexed token. This
module knows nothing about gRPC.

The lookup is one of the reads a step waits for, so it goes through the worker's
``HistoryBreaker`` (shared with its global feed): at most its deadline
(``RHYMERL_WORKER_HISTORY_TIMEOUT_S``), and skipped for a while after one timed out, the
items then drafting from siblings and the prompt (a hung history must not hold steps up).

History only speeds drafting up, so bad history never fails a step: a response the drafter
refuses (a token id outside [0, 2^31 - 1], as older history services stored unchecked) is
skipped, and if the drafter still refuses the prompt's history, that prompt drafts without
it; either way with one WARNING line per prompt and step.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np

from services.history.breaker import HistoryBreaker
from services.rollout.drafter.compiled import MAX_TOKEN as MAX_TOKEN_ID  # the drafters' token ids: [0, it]

log = logging.getLogger(__name__)

MAX_PROMPTS_IN_DRAFTER = 10_000
MAX_HISTORY_TOKENS = 32 * 1024 * 1024  # earlier epochs' tokens over all prompts (about 3 GB indexed)


def first_bad_token(tokens) -> int | None:
    """The first token id of a response outside [0, MAX_TOKEN_ID] (None: all in range, or
    not integers at all: the drafter then words its own refusal)."""
    try:
        arr = np.asarray(tokens, dtype=np.int64).reshape(-1)
    except (TypeError, ValueError, OverflowError):
        return None
    bad = np.flatnonzero((arr < 0) | (arr > MAX_TOKEN_ID))
    return int(arr[bad[0]]) if bad.size else None


class DrafterHistory:
    def __init__(self, drafter, history, call, max_epochs: int = 4, max_prompts: int = MAX_PROMPTS_IN_DRAFTER,
                 breaker: HistoryBreaker | None = None, max_tokens: int = MAX_HISTORY_TOKENS):
        """drafter: the engine's drafter; history: a history client; call: runs a function
        on the engine's thread (the drafter is not thread-safe) and returns an awaitable
        of it (the worker's: ``EngineLoop.call_deferred(urgent=True)``, behind the next
        forward's launch when the engine is busy); breaker: bounds the lookups (the
        worker's, shared with its global feed; None: one of its own, default deadline);
        max_tokens: earlier epochs' tokens kept over all prompts (0: no bound but the count)."""
        self.drafter = drafter
        self.history = history
        self.breaker = breaker if breaker is not None else HistoryBreaker(name="worker")
        self.call = call
        self.max_epochs = max_epochs
        self.max_prompts = max_prompts
        self.max_tokens = max_tokens
        self._loaded: OrderedDict[str, str] = OrderedDict()  # prompt_id -> step_id whose history is loaded
        self._tokens: dict[str, int] = {}  # prompt_id -> its earlier epochs' tokens in the drafter
        self.num_tokens = 0  # their sum
        config = getattr(drafter, "config", None)
        self._per_prompt = getattr(config, "max_tokens_per_prompt", None) or float("inf")

    async def load(self, items) -> None:
        """Loads earlier epochs of the items' prompts new to their step (one round trip,
        bounded by the breaker). A failed, timed-out or skipped lookup loads nothing:
        drafting from siblings still works (the breaker logs one WARNING per outage)."""
        wanted = {(it.prompt_id, it.step_id) for it in items if self._loaded.get(it.prompt_id) != it.step_id}
        if not wanted:
            return
        prompt_ids = sorted({p for p, _ in wanted})
        try:
            found = await self.breaker.read(
                lambda: self.history.get_history(prompt_ids, max_epochs=self.max_epochs, include_tokens=True),
                "earlier epochs lookup")
        except Exception as exc:  # noqa: BLE001 - drafting from siblings still works
            log.debug("%d prompts draft without their history: %s", len(prompt_ids), exc)
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
            self._load_one(prompt_id, responses, ages, rewards)
            self._loaded[prompt_id] = step_id  # (even if refused: the next batch of the step does not retry)
            self._loaded.move_to_end(prompt_id)
            tokens = int(min(sum(map(len, responses)), self._per_prompt))
            self.num_tokens += tokens - self._tokens.get(prompt_id, 0)
            self._tokens[prompt_id] = tokens
        while len(self._loaded) > self.max_prompts or (
                self.max_tokens and self.num_tokens > self.max_tokens and len(self._loaded) > 1):
            old, _ = self._loaded.popitem(last=False)
            self.num_tokens -= self._tokens.pop(old, 0)
            self.drafter.release_prompt(old)

    def _load_one(self, prompt_id: str, responses: list, ages: list, rewards: list) -> None:
        """One prompt's history into the drafter; never raises. Checked only once the drafter
        refused it (the common case costs no second pass over millions of tokens): the
        responses with a bad token id are then skipped and the rest loaded."""
        try:
            self.drafter.load_history(prompt_id, responses, epoch_ages=ages, rewards=rewards)
            return
        except Exception as exc:  # noqa: BLE001 - drafts are a speed-up: bad history costs them, never samples
            refusal = exc
        bad = [(n, t) for n, t in enumerate(map(first_bad_token, responses)) if t is not None]
        if bad:
            skip = {n for n, _ in bad}
            keep = [n for n in range(len(responses)) if n not in skip]
            try:
                self.drafter.load_history(prompt_id, [responses[n] for n in keep],
                                          epoch_ages=[ages[n] for n in keep], rewards=[rewards[n] for n in keep])
                log.warning("history of prompt %r: skipped %d of %d responses with a token id out of range "
                            "[0, %d] (first: %d)", prompt_id, len(bad), len(responses), MAX_TOKEN_ID, bad[0][1])
                return
            except Exception as exc:  # noqa: BLE001 - as above
                refusal = exc
        log.warning("history of prompt %r not loaded (%d responses): the drafter refused it: %s: %s",
                    prompt_id, len(responses), type(refusal).__name__, refusal)
