"""The engine thread bridge: a request that makes engine steps fail (a poison request)
gets the error; the requests that shared its batch are re-run and come back exactly as
in a run without it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.rollout.engine_loop import AbortedChunk, EngineLoop, ItemFailed
from services.rollout.loader import init_random_model
from tests.rollout.engine.test_engine import CONFIG, make_request, new_engine, prompt_of


@pytest.fixture(scope="module")
def model():
    return init_random_model(CONFIG, seed=1)


class PoisonedEngine:
    """Wraps an engine so that every step raises while a poison request is in it."""

    def __init__(self, engine, poison: set[str]):
        self.engine, self.poison = engine, poison
        self.num_failed_steps = 0
        self.on_first_failure = None

    def step(self):
        if self.poison & set(self.engine.seqs):
            self.num_failed_steps += 1
            if self.num_failed_steps == 1 and self.on_first_failure is not None:
                self.on_first_failure()
            raise RuntimeError("injected engine failure")
        return self.engine.step()

    def __getattr__(self, name):
        return getattr(self.engine, name)


def run_loop(engine, requests, abort: str | None = None) -> dict:
    async def main():
        loop = EngineLoop(engine, "w-test", asyncio.get_running_loop())
        loop.start()
        sink: asyncio.Queue = asyncio.Queue()
        try:
            if abort is not None:  # while the failed batch waits to be re-run in halves
                engine.on_first_failure = lambda: loop.abort(abort)
            for r in requests:
                loop.submit(r, sink)
            results = {}
            while len(results) < len(requests):
                out = await asyncio.wait_for(sink.get(), 60)
                results[out.request_id] = out
            return results
        finally:
            loop.stop()
    return asyncio.run(main())


def requests():
    good = [make_request(i, prompt_of(6 + i), temperature=1.0, max_tokens=20, max_new_tokens=20) for i in range(7)]
    bad = make_request(99, prompt_of(9), request_id="bad", temperature=1.0, max_tokens=20, max_new_tokens=20)
    return good, bad


@pytest.mark.parametrize("position", [0, 3, 7])
def test_a_poison_request_fails_alone_and_its_batch_mates_are_rerun_identically(model, position):
    good, bad = requests()
    clean = run_loop(new_engine(model), good)
    batch = good[:position] + [bad] + good[position:]
    engine = PoisonedEngine(new_engine(model), {"bad"})
    got = run_loop(engine, batch)
    assert isinstance(got["bad"], ItemFailed) and "injected engine failure" in str(got["bad"].error)
    for r in good:
        assert got[r.request_id].token_ids == clean[r.request_id].token_ids
        assert got[r.request_id].logprobs == pytest.approx(clean[r.request_id].logprobs, abs=1e-5)
    # the halving found it in about log2(8) + 1 failed runs, not one per request
    assert engine.num_failed_steps <= 4
    assert not engine.engine.seqs and engine.engine.block_manager.usage() == 0.0


def test_an_abort_while_isolating_reaches_its_caller(model):
    good, bad = requests()
    engine = PoisonedEngine(new_engine(model), {"bad"})
    got = run_loop(engine, good + [bad], abort="r2")
    assert isinstance(got["r2"], AbortedChunk)
    assert isinstance(got["bad"], ItemFailed)
    assert all(hasattr(got[r.request_id], "token_ids") for r in good if r.request_id != "r2")


class GatedEngine:
    """Wraps an engine: its first step waits for ``gate`` (so a command is known to reach
    the loop while the engine is busy), and every step counts itself and is flagged while
    it runs. ``defer`` hidden: an engine without it (vLLM's)."""

    def __init__(self, engine, has_defer: bool = True):
        self.engine, self.has_defer = engine, has_defer
        self.gate, self.stepping = threading.Event(), threading.Event()
        self.in_step, self.num_steps = False, 0

    def step(self):
        self.in_step = True
        try:
            self.stepping.set()
            assert self.gate.wait(60)
            out = self.engine.step()
            self.num_steps += 1
            return out
        finally:
            self.in_step = False

    def __getattr__(self, name):
        if name == "defer" and not self.has_defer:
            raise AttributeError(name)
        return getattr(self.engine, name)


def run_deferred(engine: GatedEngine, costs: list[int]) -> tuple[list[tuple], dict]:
    """Sends a call_deferred before any request (an idle engine: it runs at once), then a
    request, then, once its first step runs, one call per cost; returns each call's
    (name, ran inside a step, steps done, engine busy) and the request's output."""
    ran: list[tuple] = []

    def call(name):
        def fn():
            ran.append((name, engine.in_step, engine.num_steps, engine.engine.has_unfinished()))
            return name
        return fn

    async def main():
        loop = EngineLoop(engine, "w-test", asyncio.get_running_loop(), deferred_cost_per_step=10)
        loop.start()
        sink: asyncio.Queue = asyncio.Queue()
        try:
            first = loop.call_deferred(call("idle"), 10**6)
            loop.submit(make_request(0, prompt_of(6), max_tokens=12, max_new_tokens=12), sink)
            assert await asyncio.wait_for(first, 60) == "idle"
            assert await asyncio.to_thread(engine.stepping.wait, 60)
            futures = [loop.call_deferred(call(f"c{i}"), cost) for i, cost in enumerate(costs)]
            urgent = loop.call_deferred(call("urgent"), 10**6, urgent=True)  # sent last, runs first
            engine.gate.set()
            out = await asyncio.wait_for(sink.get(), 60)
            assert [await asyncio.wait_for(f, 60) for f in futures] == [f"c{i}" for i in range(len(costs))]
            assert await asyncio.wait_for(urgent, 60) == "urgent"
            return out
        finally:
            loop.stop()

    out = asyncio.run(main())
    return ran, out


@pytest.mark.parametrize("has_defer", [True, False])
def test_a_deferred_call_runs_at_once_when_idle_else_paced_where_it_delays_no_forward(model, has_defer):
    engine = GatedEngine(new_engine(model, deferred_cost_per_step=10), has_defer)  # (the loop's: 10 too)
    ran, out = run_deferred(engine, [6, 6, 20])
    assert ran[0] == ("idle", False, 0, False)  # before the request was applied
    # the urgent call (a history load a request waits for) behind the very next forward,
    # ahead of the paced ones sent before it, whatever its cost
    assert ran[1][0] == "urgent" and ran[1][1] == has_defer and ran[1][3]
    assert ran[1][2] == ran[2][2]  # with the first paced call, in the same step
    calls = ran[2:]
    assert [name for name, *_ in calls] == ["c0", "c1", "c2"]
    # each paced: one a step (6 + 6 > 10; 20 alone), none run at once although sent together
    steps = [n for _, _, n, _ in calls]
    assert steps == sorted(steps) and len(set(steps)) == 3 and steps[0] >= (0 if has_defer else 1)
    if has_defer:  # behind a forward: inside step(), while the engine works
        assert all(inside and busy for _, inside, _, busy in calls)
    else:  # between two steps, while work is left
        assert all(not inside and busy for _, inside, _, busy in calls)
    assert len(out.token_ids) == 12
