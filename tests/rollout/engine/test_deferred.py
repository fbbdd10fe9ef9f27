"""Deferred calls (engine/deferred.py, ``LLMEngine.defer``): work no step waits for runs
right after a forward's launch, in order, at most a step's budget of cost behind each
forward, all that is left once the engine is idle; a call that raises fails no step."""

from __future__ import annotations

import logging

import pytest

from services.rollout.engine.deferred import DeferredCalls
from services.rollout.engine.engine import run_to_completion
from services.rollout.loader import init_random_model
from tests.rollout.engine.test_engine import CONFIG, make_request, new_engine, prompt_of


@pytest.fixture(scope="module")
def model():
    return init_random_model(CONFIG, seed=1)


def test_calls_run_in_order_within_the_budget_and_the_first_always_runs():
    calls, ran = DeferredCalls(), []
    for name, cost in (("a", 5), ("b", 4), ("c", 2), ("d", 9), ("e", 0)):
        calls.add(lambda name=name: ran.append(name), cost)
    assert calls.run(10) == 2 and ran == ["a", "b"]  # c would make 11
    assert calls.run(1) == 1 and ran[-1] == "c"  # over the budget alone: it still runs
    assert calls.run(1) == 1 and ran[-1] == "d"
    assert calls.run(0) == 1 and ran[-1] == "e"
    assert len(calls) == 0 and calls.run(5) == 0


def test_none_runs_everything_and_a_raising_call_is_logged_and_dropped(caplog):
    calls, ran = DeferredCalls(), []

    def broken():
        raise RuntimeError("drafter bug")

    calls.add(lambda: ran.append(1), 100)
    calls.add(broken, 100)
    calls.add(lambda: ran.append(3), 100)
    with caplog.at_level(logging.ERROR):
        assert calls.run() == 3
    assert ran == [1, 3] and len(calls) == 0
    assert "a deferred call failed" in caplog.text and "drafter bug" in caplog.text
    with pytest.raises(ValueError, match="cost"):
        calls.add(lambda: None, -1)


class Recorder:
    """Logs each forward's launch (``ModelRunner.run``) and each deferred call, in order."""

    def __init__(self, engine):
        self.log: list[str] = []
        self.in_step = False
        run, step = engine.runner.run, engine.step

        def logged_run(*args, **kw):
            self.log.append("forward")
            return run(*args, **kw)

        def logged_step():
            self.in_step = True
            try:
                return step()
            finally:
                self.in_step = False

        engine.runner.run, engine.step = logged_run, logged_step

    def call(self, name: str):
        def fn():
            assert self.in_step, "a deferred call ran outside a step while the engine was busy"
            self.log.append(name)
        return fn


@pytest.mark.parametrize("overlap", [True, False])
def test_deferred_calls_run_right_after_a_forward_a_budget_at_a_time_then_all_when_idle(model, overlap):
    engine = new_engine(model, deferred_cost_per_step=10, overlap=overlap)
    reqs = [make_request(i, prompt_of(5 + i), max_tokens=12, max_new_tokens=12) for i in range(3)]
    plain = run_to_completion(new_engine(model, overlap=overlap), reqs)
    rec = Recorder(engine)
    for r in reqs:
        engine.add_request(r)
    for i in range(5):
        engine.defer(rec.call(f"c{i}"), cost=4)
    assert engine.num_deferred() == 5
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] = o
    # two calls (4 + 4 <= 10) behind each of the first forwards, each after its forward
    assert rec.log[:9] == ["forward", "c0", "c1", "forward", "c2", "c3", "forward", "c4", "forward"]
    assert engine.num_deferred() == 0
    # nothing else changed: the same chunks as an engine given no calls
    assert {r: (o.token_ids, o.logprobs) for r, o in out.items()} == \
        {r: (o.token_ids, o.logprobs) for r, o in plain.items()}
    # handed over while idle, a call waits for the next step or an idle step() drains it
    engine.defer(rec.call("late"), cost=100)
    assert engine.step() == [] and rec.log[-1] == "late" and engine.num_deferred() == 0


def test_a_costlier_call_runs_alone_behind_one_forward_and_a_raising_one_fails_no_step(model, caplog):
    engine = new_engine(model, deferred_cost_per_step=10)
    rec = Recorder(engine)
    engine.add_request(make_request(0, prompt_of(7), max_tokens=10, max_new_tokens=10))

    def broken():
        raise RuntimeError("drafter bug")

    engine.defer(rec.call("big"), cost=50)
    engine.defer(broken, cost=1)
    engine.defer(rec.call("after"), cost=1)
    with caplog.at_level(logging.ERROR):
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
    assert rec.log[:5] == ["forward", "big", "forward", "after", "forward"]
    assert "drafter bug" in caplog.text
    assert len(outputs) == 1 and len(outputs[0].token_ids) == 10


def test_a_reset_runs_what_was_deferred(model):
    engine = new_engine(model)
    engine.add_request(make_request(0, prompt_of(7)))
    ran = []
    engine.step()
    for i in range(3):
        engine.defer(lambda i=i: ran.append(i), cost=engine.deferred_cost_per_step)
    assert engine.reset() == ["r0"]
    assert ran == [0, 1, 2] and engine.num_deferred() == 0
    with pytest.raises(ValueError, match="deferred_cost_per_step"):
        new_engine(model, deferred_cost_per_step=0)


def test_urgent_calls_run_first_and_all_at_the_next_run_whatever_the_budget():
    calls, ran = DeferredCalls(), []
    calls.add(lambda: ran.append("feed0"), 8)
    calls.add(lambda: ran.append("feed1"), 8)
    calls.add(lambda: ran.append("load0"), 10**6, urgent=True)
    calls.add(lambda: ran.append("load1"), urgent=True)
    assert len(calls) == 4
    assert calls.run(10) == 3 and ran == ["load0", "load1", "feed0"]  # and one paced call still
    assert calls.run(10) == 1 and ran[-1] == "feed1" and len(calls) == 0
