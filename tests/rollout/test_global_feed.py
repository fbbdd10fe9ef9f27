"""GlobalFeed: a worker's own finished samples and the history service's recent-responses
stream reach the drafter's global index, each response once, and a failing feed never
raises into the worker."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from prometheus_client import REGISTRY

from services.history.recent import RecentResponse
from services.rollout.drafter import DrafterConfig, HistoDrafter
from services.rollout.global_feed import GlobalFeed, chunks


class InlineLoop:
    """Stands in for EngineLoop: runs the call at once (the engine thread is not needed
    to check what reaches the drafter), as EngineLoop does while the engine is idle."""

    def __init__(self):
        self.costs: list[int] = []

    def call_deferred(self, fn, cost=0):
        self.costs.append(cost)
        future = asyncio.get_running_loop().create_future()
        try:
            future.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - as EngineLoop hands it back
            future.set_exception(exc)
        return future


class HeldLoop:
    """Stands in for a busy EngineLoop: keeps each call (fn, cost, future) until ``land``."""

    def __init__(self):
        self.held: list[tuple] = []

    def call_deferred(self, fn, cost=0):
        future = asyncio.get_running_loop().create_future()
        self.held.append((fn, cost, future))
        return future

    def land(self):
        held, self.held = self.held, []
        for fn, _, future in held:
            future.set_result(fn())


class RecordingDrafter:
    def __init__(self):
        self.batches: list[list[list[int]]] = []

    def add_global_responses(self, responses):
        self.batches.append([list(map(int, r)) for r in responses])


class FakeHistory:
    """Newest first, as the history service answers."""

    def __init__(self, recent: list[RecentResponse], fail: bool = False):
        self.recent, self.fail, self.calls = recent, fail, []

    async def get_recent_responses(self, max_responses, max_tokens):
        self.calls.append((max_responses, max_tokens))
        if self.fail:
            raise ConnectionError("history down")
        return self.recent


def _recent(prompt_id, step_id, sample_index, tokens):
    return RecentResponse(prompt_id, step_id, sample_index, np.asarray(tokens, dtype="<i4"))


async def _drain():
    for _ in range(3):  # (each call's future counts it in a callback)
        await asyncio.sleep(0)


def test_finished_samples_reach_the_real_drafter_and_it_drafts_from_them():
    drafter = HistoDrafter(DrafterConfig(min_gain=0.0))
    feed = GlobalFeed(InlineLoop(), drafter)
    response = [5, 6, 7, 8, 9, 10, 11, 12]

    async def main():
        feed.finished("p0", "s0", 0, response)
        await _drain()

    asyncio.run(main())
    assert feed.num_added == 1
    assert drafter.global_tokens() >= len(response)
    # a request of another prompt, whose text matches the response's start, drafts its rest
    drafter.start_request("r", "p1", [1, 2, 3], generated_token_ids=[5, 6, 7])
    (draft,) = drafter.propose(["r"], [8])
    assert draft and draft == response[3:3 + len(draft)]


def test_each_response_is_added_once_whichever_feed_brings_it_first():
    drafter = RecordingDrafter()
    history = FakeHistory([_recent("p1", "s1", 0, [4, 4, 4]), _recent("p0", "s1", 2, [1, 2, 3])])
    feed = GlobalFeed(InlineLoop(), drafter, history)

    async def main():
        feed.finished("p0", "s1", 2, [1, 2, 3])
        feed.finished("p0", "s1", 2, [1, 2, 3])  # the same sample again: ignored
        feed.finished("p0", "s1", 3, [])  # an empty response: nothing to index
        await _drain()
        await feed.step_started({"s1"})

    asyncio.run(main())
    assert drafter.batches == [[[1, 2, 3]], [[4, 4, 4]]]
    assert feed.num_added == 2


def test_the_stream_is_read_once_per_new_step_and_added_oldest_first():
    drafter = RecordingDrafter()
    newest_first = [_recent("a", "s2", 0, [3]), _recent("b", "s1", 0, [2]), _recent("c", "s1", 1, [1])]
    history = FakeHistory(newest_first)
    feed = GlobalFeed(InlineLoop(), drafter, history, max_responses=7, max_tokens=99)

    async def main():
        await feed.step_started({"s2"})
        await feed.step_started({"s2"})  # same step: no second read

    asyncio.run(main())
    assert history.calls == [(7, 99)] and feed.num_added == 3
    # oldest first, so the global index (which forgets its oldest) keeps the newest longest
    assert drafter.batches == [[[1], [2], [3]]]


def test_a_failing_history_or_drafter_never_raises_into_the_worker():
    failing_history = FakeHistory([], fail=True)
    feed = GlobalFeed(InlineLoop(), RecordingDrafter(), failing_history)

    class BrokenDrafter:
        def add_global_responses(self, responses):
            raise RuntimeError("bug")

    broken = GlobalFeed(InlineLoop(), BrokenDrafter())

    async def main():
        await feed.step_started({"s0"})
        broken.finished("p", "s0", 0, [1, 2])
        await _drain()

    asyncio.run(main())
    assert failing_history.calls and feed.num_added == 0
    assert broken.num_added == 0


def test_without_a_history_client_only_own_samples_feed():
    drafter = RecordingDrafter()
    feed = GlobalFeed(InlineLoop(), drafter, history=None)

    async def main():
        await feed.step_started({"s0"})
        feed.finished("p", "s0", 0, [9, 9])
        await _drain()

    asyncio.run(main())
    assert drafter.batches == [[[9, 9]]]


def test_a_step_start_hands_the_stream_over_in_chunks_and_does_not_wait_for_them():
    """A busy engine takes the stream a few chunks a step (LLMEngine.defer): the step's
    items must not wait for that, and each chunk is priced by its tokens."""
    drafter = RecordingDrafter()
    sizes = [3, 4, 2, 9, 1, 1]  # oldest first once read; the 9-token one is longer than a chunk
    newest_first = [_recent(f"p{i}", "s1", 0, [i] * n) for i, n in reversed(list(enumerate(sizes)))]
    loop = HeldLoop()
    feed = GlobalFeed(loop, drafter, FakeHistory(newest_first), chunk_tokens=7, worker_id="w-feed")

    def series(name):  # the worker's Prometheus series
        return REGISTRY.get_sample_value(f"rhymerl:{name}", {"worker": "w-feed"}) or 0.0

    added_before = series("drafter_feed_responses_total")

    async def main():
        await asyncio.wait_for(feed.step_started({"s1"}), 5)  # returns with nothing landed
        assert [cost for _, cost, _ in loop.held] == [7, 2, 9, 2]
        assert feed.num_added == 0 and feed.num_pending == 6 and drafter.batches == []
        assert series("drafter_feed_pending_responses") == 6
        loop.land()
        await _drain()

    asyncio.run(main())
    assert drafter.batches == [[[0] * 3, [1] * 4], [[2] * 2], [[3] * 9], [[4], [5]]]
    assert feed.num_added == 6 and feed.num_pending == 0
    assert series("drafter_feed_pending_responses") == 0
    assert series("drafter_feed_responses_total") - added_before == 6


def test_chunks_keep_the_order_and_cut_at_the_budget():
    rs = [[1] * 5, [2] * 5, [3] * 20, [4], [5] * 9]
    assert chunks(rs, 10) == [([rs[0], rs[1]], 10), ([rs[2]], 20), ([rs[3], rs[4]], 10)]
    assert chunks([], 10) == []
    with pytest.raises(ValueError, match="chunk_tokens"):
        GlobalFeed(InlineLoop(), RecordingDrafter(), chunk_tokens=0)


def test_a_backlog_past_its_bound_drops_its_oldest_chunks_unread():
    """A busy engine takes a few chunks a step; what waits beyond the index's capacity
    (which would keep only its newest tokens anyway) is dropped, oldest first, so the
    backlog's memory is bounded."""
    drafter = RecordingDrafter()
    loop = HeldLoop()
    feed = GlobalFeed(loop, drafter, chunk_tokens=4, max_backlog_tokens=10)

    async def main():
        for i in range(6):  # six finished samples of 4 tokens: 24 tokens waiting
            feed.finished(f"p{i}", "s0", 0, [i] * 4)
        assert feed.num_pending == 2 and feed.num_dropped == 4  # 8 tokens kept: the two newest
        loop.land()
        await _drain()

    asyncio.run(main())
    assert drafter.batches == [[[4] * 4], [[5] * 4]]
    assert feed.num_added == 2 and feed.num_pending == 0 and feed.num_dropped == 4
    # bounded by default by the drafter's own capacity
    assert GlobalFeed(InlineLoop(), HistoDrafter(DrafterConfig(global_max_tokens=64))).max_backlog_tokens == 64
    with pytest.raises(ValueError, match="max_backlog_tokens"):
        GlobalFeed(InlineLoop(), drafter, max_backlog_tokens=0)


def test_streamed_responses_the_compiled_drafter_refuses_are_skipped_alone(caplog):
    """Breaks if one bad response in the history stream (a negative token id, as stored
    before PutRollouts checked them) loses its whole chunk or logs an error per step: the
    chunk's other responses must still reach the index, with one WARNING."""
    from services.rollout.drafter.compiled import make_drafter

    drafter = make_drafter("compiled", DrafterConfig(min_gain=0.0))
    newest_first = [_recent("p2", "s0", 0, [9, 10, 11]), _recent("p1", "s0", 0, [28, 12, -5, 99]),
                    _recent("p0", "s0", 0, [5, 6, 7, 8])]
    feed = GlobalFeed(InlineLoop(), drafter, FakeHistory(newest_first))

    async def main():
        await feed.step_started({"s1"})
        await _drain()

    caplog.set_level("WARNING")
    asyncio.run(main())
    assert feed.num_added == 2 and feed.num_pending == 0
    assert drafter.global_tokens() >= 7
    assert [r.levelname for r in caplog.records] == ["WARNING"], caplog.text
    assert "skipped 1 of 3" in caplog.records[0].getMessage() and "-5" in caplog.records[0].getMessage()
