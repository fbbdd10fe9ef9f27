"""The engine thread bridge: a request that makes engine steps fail (a poison request)
gets the error; the requests that shared its batch are re-run and come back exactly as
in a run without it."""

from __future__ import annotations

import asyncio

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
