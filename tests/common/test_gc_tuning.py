"""The garbage collector of a service process (services/common/gc_tuning.py): the
thresholds' parsing, StepCollector's choice of generation (CPython's, by gc.get_count),
and the worker's engine collecting behind each step's forward, nowhere else in its steps.

Each test that changes the process's collector (thresholds, frozen objects, disabled)
puts it back as it was."""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

import pytest
import torch
from prometheus_client import REGISTRY
from pydantic import ValidationError

from services.common.gc_tuning import AUTOMATIC_FACTOR, StepCollector, parse_thresholds
from services.rollout.engine import LLMEngine
from services.rollout.server import tune_worker_gc
from services.rollout.settings import WorkerSettings
from tests.rollout.engine.test_engine import CONFIG, OracleDrafter, make_request, prompt_of, run_to_end


@contextmanager
def collector_restored():
    thresholds, enabled, callbacks = gc.get_threshold(), gc.isenabled(), list(gc.callbacks)
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
        (gc.enable if enabled else gc.disable)()
        gc.callbacks[:] = callbacks


def pauses(worker: str, where: str) -> float:
    return REGISTRY.get_sample_value("rhymerl:gc_pause_seconds_count", {"worker": worker, "where": where}) or 0.0


@contextmanager
def collections_seen(others: list | None = None):
    """The generation of every collection started in this thread while inside (another
    thread's, e.g. a server left by an earlier test, is not this thread's steps': those go
    to `others`)."""
    seen: list[int] = []
    thread = threading.get_ident()

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            (seen if threading.get_ident() == thread else others if others is not None else []).append(
                info["generation"])

    gc.callbacks.append(callback)
    try:
        yield seen
    finally:
        gc.callbacks.remove(callback)


def test_thresholds_parse_or_name_the_field():
    assert parse_thresholds("700, 10,100", "f") == (700, 10, 100)
    assert parse_thresholds(" ", "f") is None
    for bad in ("700,10", "a,b,c", "700,10,-1", "1,2,3,4"):
        with pytest.raises(ValueError, match="^f: three"):
            parse_thresholds(bad, "f")
    assert WorkerSettings().gc_threshold_values() == (700, 10, 100)
    assert WorkerSettings(gc_thresholds="").gc_threshold_values() is None
    for bad in ("0,10,10", "700,10", "x"):
        with pytest.raises(ValidationError, match="gc_thresholds"):
            WorkerSettings(gc_thresholds=bad)


def test_step_collector_collects_the_generation_cpython_would():
    """Young objects up to the threshold: nothing; over it: generation 0; after three of
    those (middle=3) the next is generation 1, and after two of those (old=2) the next is
    everything."""
    collector = StepCollector((50, 3, 2))
    with collector_restored(), collections_seen() as seen:
        gc.disable()  # no automatic collection in between
        gc.collect()  # counts (0, 0, 0)
        assert seen == [2]  # (the reset's own collection: full)
        kept = []
        generations = []
        for _ in range(16):
            kept.append([[] for _ in range(60)])  # 61 container objects, alive
            generations.append(collector())
        assert generations == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 2]
        assert seen[1:] == generations
        assert collector.collections == [12, 3, 1]
        gc.collect()
        assert collector() == -1  # (nothing young: only this thread runs here)


def test_install_freezes_start_up_objects_and_defers_automatic_collections():
    collector = StepCollector((700, 10, 100))
    with collector_restored():
        frozen = gc.get_freeze_count()
        collector.install()
        assert gc.get_threshold() == (700 * AUTOMATIC_FACTOR, 10, 100)
        assert gc.get_freeze_count() > frozen


@pytest.fixture(scope="module")
def model():
    from services.rollout.loader import init_random_model

    torch.manual_seed(0)
    return init_random_model(CONFIG, seed=1)


def engine_with(model, drafter=None) -> LLMEngine:
    return LLMEngine(model, device="cpu", num_kv_blocks=256, block_size=16, max_num_batched_tokens=512,
                     max_num_seqs=16, drafter=drafter, speculative=drafter is not None)


@pytest.mark.parametrize("speculative", [False, True])
def test_the_worker_engine_collects_behind_the_forward_and_nowhere_else_in_a_step(model, speculative):
    """With the worker's collector installed (a small young threshold, so that a short run
    needs several), every collection during the engine's steps runs in the collector's
    call, which the engine makes once per step right after launching the forward; the
    outputs are those of an engine without it (and with drafts, of plain decoding)."""
    requests = [make_request(i, prompt_of(6 + i, i), max_tokens=40, max_new_tokens=40) for i in range(12)]
    reference = engine_with(model)
    for r in requests:
        reference.add_request(r)
    expected = {k: (o.token_ids, o.logprobs) for k, o in run_to_end(reference).items()}

    # drafts: the true continuations, every third token wrong (accepted and rejected drafts)
    e = engine_with(model, OracleDrafter({k: v[0] for k, v in expected.items()}, 3) if speculative else None)
    order: list[str] = []
    run = e.runner.run

    def forward(*args, **kw):
        order.append("forward")
        return run(*args, **kw)

    e.runner.run = forward
    others: list[int] = []
    with collector_restored(), collections_seen(others) as seen:
        settings = WorkerSettings(gc_thresholds="20,3,4")
        worker = f"gc-test-{speculative}"
        collector = tune_worker_gc(settings, e, worker)
        assert isinstance(collector, StepCollector) and e.collector is collector
        in_window = []

        def window() -> int:
            before = len(seen)
            generation = collector()
            in_window.append(len(seen) - before)
            order.append("collector")
            return generation

        e.collector = window
        del seen[:]  # (install's own collection)
        exported = pauses(worker, "forward"), pauses(worker, "elsewhere")
        del others[:]
        for r in requests:
            e.add_request(r)
        outputs = run_to_end(e)
        exported = pauses(worker, "forward") - exported[0], pauses(worker, "elsewhere") - exported[1]
    assert {k: (o.token_ids, o.logprobs) for k, o in outputs.items()} == expected
    assert order == ["forward", "collector"] * (len(order) // 2)  # once per step, after the launch
    assert sum(collector.collections) >= 2
    assert len(seen) == sum(in_window) == sum(collector.collections)  # none elsewhere
    # rhymerl:gc_pause_seconds, by where they ran (another thread's are automatic ones: elsewhere)
    assert exported == (sum(collector.collections), len(others))


def test_the_worker_leaves_the_collector_alone_when_told_and_tunes_vllm_plainly():
    class VllmLike:  # an engine whose step is not ours to split (no `collector`)
        pass

    with collector_restored():
        before, frozen = gc.get_threshold(), gc.get_freeze_count()
        assert tune_worker_gc(WorkerSettings(gc_thresholds=""), VllmLike()) is None
        assert gc.get_threshold() == before and gc.get_freeze_count() == frozen
        assert tune_worker_gc(WorkerSettings(gc_thresholds="900,11,99"), VllmLike()) is None
        assert gc.get_threshold() == (900, 11, 99) and gc.get_freeze_count() > frozen
