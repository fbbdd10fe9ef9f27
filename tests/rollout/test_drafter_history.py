"""The drafter's history policy: which epochs it loads, NaN rewards for unscored epochs,
and the bound on prompts it keeps (services/rollout/drafter_history.py)."""

import asyncio
import math
from types import SimpleNamespace

from services.rollout.drafter_history import DrafterHistory


class _Drafter:
    def __init__(self):
        self.loaded, self.released = {}, []

    def load_history(self, prompt_id, responses, epoch_ages, rewards):
        self.loaded[prompt_id] = (responses, epoch_ages, rewards)

    def release_prompt(self, prompt_id):
        self.released.append(prompt_id)


class _History:
    def __init__(self, epochs):
        self.epochs, self.calls = epochs, []

    async def get_history(self, prompt_ids, max_epochs, include_tokens):
        self.calls.append((tuple(prompt_ids), max_epochs))
        return {p: self.epochs.get(p, []) for p in prompt_ids}


async def _call(fn):
    return fn()


def _epoch(step_id, responses, rewards):
    return SimpleNamespace(step_id=step_id, responses=responses, rewards=rewards)


def _item(prompt_id, step_id):
    return SimpleNamespace(prompt_id=prompt_id, step_id=step_id)


def test_loads_earlier_epochs_newest_first_with_nan_for_unscored_and_skips_the_step_itself():
    """Breaks if the step's own epoch is loaded as history, ages are wrong, or an epoch
    whose rewards are missing gets made-up rewards instead of NaN."""
    history = _History({"p": [_epoch("s3", [[9]], [1.0]), _epoch("s2", [[1], [2]], [0.5, 0.0]),
                              _epoch("s1", [[3], [4]], [])]})
    drafter = _Drafter()
    loader = DrafterHistory(drafter, history, _call, max_epochs=4)
    asyncio.run(loader.load([_item("p", "s3")]))
    responses, ages, rewards = drafter.loaded["p"]
    assert responses == [[1], [2], [3], [4]] and ages == [0, 0, 1, 1]
    assert rewards[:2] == [0.5, 0.0] and all(math.isnan(r) for r in rewards[2:])
    assert history.calls == [(("p",), 4)]
    asyncio.run(loader.load([_item("p", "s3")]))  # already loaded for this step: no round trip
    assert len(history.calls) == 1


def test_keeps_only_the_most_recently_used_prompts():
    """Breaks if the drafter's memory grows without bound over many prompts."""
    drafter = _Drafter()
    loader = DrafterHistory(drafter, _History({}), _call, max_prompts=2)
    for prompt_id in ("a", "b", "a", "c"):
        asyncio.run(loader.load([_item(prompt_id, f"s-{prompt_id}-{len(drafter.loaded)}")]))
    assert drafter.released == ["b"]


def test_keeps_at_most_max_tokens_of_earlier_epochs_over_all_prompts():
    """Breaks if only the prompt count bounds the drafter's memory (10,000 prompts at their
    index's cap: tens of GB): past max_tokens the least recently used prompts are released,
    each counted up to the drafter's max_tokens_per_prompt, and the newest is always kept."""
    from services.rollout.drafter.config import DrafterConfig

    drafter = _Drafter()
    drafter.config = DrafterConfig(max_tokens_per_prompt=64)
    epochs = {p: [_epoch("s0", [[1] * 30, [2] * 30], [0.0, 1.0])] for p in "abcd"}  # 60 tokens each
    epochs["e"] = [_epoch("s0", [[3] * 100] * 3, [0.0] * 3)]  # 300 tokens, 64 indexed
    loader = DrafterHistory(drafter, _History(epochs), _call, max_tokens=150)
    for prompt_id in "abc":
        asyncio.run(loader.load([_item(prompt_id, "s1")]))
    assert drafter.released == ["a"] and loader.num_tokens == 120
    asyncio.run(loader.load([_item("b", "s2")]))  # b used again: c is the oldest now
    asyncio.run(loader.load([_item("e", "s2")]))
    assert drafter.released == ["a", "c"] and loader.num_tokens == 60 + 64
    one = DrafterHistory(_Drafter(), _History(epochs), _call, max_tokens=10)
    asyncio.run(one.load([_item("d", "s1")]))
    assert one.drafter.released == [] and one.num_tokens == 60  # a prompt over the bound alone is kept


def test_a_failed_lookup_loads_nothing():
    class _Down:
        async def get_history(self, *a, **k):
            raise ConnectionError("history down")

    drafter = _Drafter()
    asyncio.run(DrafterHistory(drafter, _Down(), _call).load([_item("p", "s")]))
    assert drafter.loaded == {}


def test_history_the_compiled_drafter_refuses_costs_its_responses_never_the_batch(caplog):
    """Breaks if a stored response with a token id the drafter cannot take (a negative one,
    as older history services stored unchecked) raises out of load, which fails the
    worker's whole Link batch: the prompt's other responses load, one WARNING says so."""
    from services.rollout.drafter import DrafterConfig
    from services.rollout.drafter.compiled import make_drafter

    drafter = make_drafter("compiled", DrafterConfig())
    history = _History({"bad": [_epoch("s1", [[28, 12, -5, 99], [5, 6, 7]], [1.0, 0.0])],
                        "good": [_epoch("s1", [[1, 2, 3]], [])]})
    caplog.set_level("WARNING")
    loader = DrafterHistory(drafter, history, _call)
    asyncio.run(loader.load([_item("bad", "s2"), _item("good", "s2")]))
    assert drafter.has_prompt("bad") and drafter.has_prompt("good")
    [record] = caplog.records
    assert record.levelname == "WARNING" and "'bad'" in record.getMessage() and "skipped 1 of 2" in record.getMessage()
    asyncio.run(loader.load([_item("bad", "s2")]))  # the step's next batch: no retry, no second line
    assert len(caplog.records) == 1 and len(history.calls) == 1


def test_history_a_drafter_refuses_whole_is_dropped_with_one_warning(caplog):
    class _Refusing(_Drafter):
        def load_history(self, prompt_id, responses, epoch_ages, rewards):
            if prompt_id == "p":
                raise RuntimeError("drafter full")
            super().load_history(prompt_id, responses, epoch_ages, rewards)

    drafter = _Refusing()
    caplog.set_level("WARNING")
    history = _History({"p": [_epoch("s1", [[1]], [])], "q": [_epoch("s1", [[2]], [])]})
    asyncio.run(DrafterHistory(drafter, history, _call).load([_item("p", "s2"), _item("q", "s2")]))
    assert list(drafter.loaded) == ["q"]
    [record] = caplog.records
    assert record.levelname == "WARNING" and "'p' not loaded" in record.getMessage()


def test_a_hung_history_costs_a_batch_one_deadline_and_the_feed_shares_the_breaker():
    """A history that takes calls and never answers: the drafter's lookup ends at the
    worker's deadline (not the client's 30 s) and loads nothing; the global feed's read
    right after it (same breaker) and the next batches' lookups are skipped without a
    call until the backoff ends; then one probes, and a history that answers again is
    read again."""
    import time

    from services.history.breaker import HistoryBreaker
    from services.rollout.global_feed import GlobalFeed

    class _Hung(_History):
        hang = True

        async def get_history(self, prompt_ids, max_epochs, include_tokens):
            self.calls.append(("get_history", tuple(prompt_ids)))
            if self.hang:
                await asyncio.Event().wait()
            return {p: [_epoch("s0", [[5, 6]], [1.0])] for p in prompt_ids}

        async def get_recent_responses(self, max_responses, max_tokens):
            self.calls.append(("get_recent_responses",))
            await asyncio.Event().wait()

    class _Clock:
        t = 0.0

        def __call__(self):
            return self.t

    class _Loop:
        def call_deferred(self, fn, cost=0):
            future = asyncio.get_running_loop().create_future()
            future.set_result(fn())
            return future

    history, drafter, clock = _Hung({}), _Drafter(), _Clock()
    breaker = HistoryBreaker(0.1, first_backoff_s=5.0, clock=clock, name="worker test")
    loader = DrafterHistory(drafter, history, _call, breaker=breaker)
    feed = GlobalFeed(_Loop(), SimpleNamespace(add_global_responses=lambda r: None), history, breaker=breaker)

    async def batch(prompt_id, step_id):
        await loader.load([_item(prompt_id, step_id)])
        await feed.step_started({step_id})

    started = time.monotonic()
    asyncio.run(batch("p", "s1"))
    assert time.monotonic() - started < 15.0  # one 0.1 s deadline; generous for a busy machine
    assert history.calls == [("get_history", ("p",))] and drafter.loaded == {}
    for k in range(3):  # the backoff runs: nothing asked, at once
        asyncio.run(batch(f"q{k}", f"s{2 + k}"))
    assert len(history.calls) == 1 and breaker.num_skipped == 7
    history.hang = False  # history is back; after the backoff, the next lookup probes and loads
    clock.t += 5.0
    asyncio.run(loader.load([_item("r", "s9")]))
    assert history.calls[-1] == ("get_history", ("r",)) and drafter.loaded["r"][0] == [[5, 6]]
    assert not breaker.is_open
