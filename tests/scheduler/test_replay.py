"""The simulator and the live scheduler make the same decisions on the same event
sequence: both drive a Policy through the same calls, so a run recorded from either
(EventRecorder) and replayed on a fresh policy of the same kind must reproduce every
placement decision exactly."""

from __future__ import annotations

import json

import pytest

from services.common.cost_curve import CostCurve
from services.scheduler.length_model import LengthModel
from services.scheduler.policies import make_policy
from services.scheduler.policies.base import Request, WorkerState
from services.scheduler.simulator import Simulator, synthetic_workload
from services.scheduler.event_log import EventRecorder, decisions_of, read_events
from services.scheduler.simulator.replay import main, policy_from_events, replay

POLICY_CONFIGS = [
    ("static", {}),
    ("seer", {"chunk_size": 256}),
    ("histopipe", {}),
    ("rhymerl", {"chunk_size": 256}),
]


def record_simulation(name: str, kw: dict, path=None, overlap: bool = False) -> EventRecorder:
    workload = synthetic_workload(24, n=8, num_epochs=4, seed=3, runaway_prob=0.02, max_tokens=4096)
    steps = [workload.step(e, history_lag=int(overlap)) for e in (0, 2, 3)]  # no history, then history
    recorder = EventRecorder(make_policy(name, **kw), path)
    result = Simulator(recorder, CostCurve.h100("7B"), 6, 4, overlap=overlap).run(steps, LengthModel())
    assert sum(s.num_samples for s in result.steps) == 3 * 24 * 8
    return recorder


@pytest.mark.parametrize("name,kw", POLICY_CONFIGS, ids=[c[0] for c in POLICY_CONFIGS])
def test_simulator_run_replays_identically_on_a_fresh_policy(name, kw, tmp_path):
    path = tmp_path / "events.jsonl"
    recorder = record_simulation(name, kw, path)
    recorder.close()
    recorded = recorder.decisions()
    assert sum(len(d["assignments"]) for d in recorded) >= 3 * 24 * 8
    events = read_events(path)  # through JSON: floats, ids and order survive the file
    assert events == json.loads(json.dumps(recorder.events))
    assert decisions_of(events) == recorded
    mismatches: list[str] = []
    assert replay(events, make_policy(name, **kw), mismatches) == recorded
    assert mismatches == []  # every request's state matched at every call, too
    assert replay(events, policy_from_events(events)) == recorded


def test_cross_step_overlap_replays_identically():
    """Two live steps at once (rhymerl's alternating order, bounded staleness 1)."""
    recorder = record_simulation("rhymerl", {"chunk_size": 256, "cross_step": True}, overlap=True)
    assert replay(recorder.events, make_policy("rhymerl", chunk_size=256, cross_step=True)) == recorder.decisions()


def test_another_policy_gives_other_decisions(tmp_path, capsys):
    """The replay is a real check: a different policy on the same events differs, and the
    command line says so (and where)."""
    path = tmp_path / "events.jsonl"
    record_simulation("rhymerl", {"chunk_size": 256}, path).close()
    assert main([str(path), "--policy", "rhymerl"]) == 0
    assert "IDENTICAL" in capsys.readouterr().out
    assert main([str(path), "--policy", "seer"]) == 1
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "recorded" in out and "replayed" in out


def test_worker_loss_cancel_and_abort_replay_identically():
    """Calls the simulator never makes (a lost worker, a cancelled step, an aborted
    sample, a worker coming back) replay too, with the requests' identity kept."""
    lengths = LengthModel({"p0": [[30, 40]], "p1": [[5, 6]]})
    recorder = EventRecorder(make_policy("rhymerl", chunk_size=4))
    workers = [WorkerState("a", 2), WorkerState("b", 2)]
    reqs = {s: [Request(s, f"p{p}", i, 3, 50) for p in range(3) for i in range(2)]
            for s in ("s1", "s2")}
    now = 0.0

    def schedule():
        assignments = recorder.schedule(workers, now)
        for a in assignments:
            next(w for w in workers if w.worker_id == a.worker_id).running[a.request.key] = a.request
        return assignments

    recorder.add_step(reqs["s1"], lengths, now)
    recorder.add_step(reqs["s2"], lengths, now)
    for tick in range(12):
        now += 0.25
        running = [(w, r) for w in workers for r in list(w.running.values())]
        if tick == 3:  # worker b dies with its chunks
            lost = list(workers[1].running.values())
            workers[1].running.clear()
            workers[1].healthy = False
            recorder.on_worker_lost("b", lost, now)
        elif tick == 5:
            workers[1].healthy = True
            recorder.cancel_step("s2")
        elif running:
            worker, request = running[0]
            del worker.running[request.key]
            if tick == 7:
                request.aborted = True  # the scheduler gives it up
                recorder.on_chunk_done(request, worker.worker_id, 0, True, now)
            else:
                recorder.on_chunk_done(request, worker.worker_id, 4, request.num_generated + 4 >= 12, now)
        schedule()
    recorded = recorder.decisions()
    ops = [e["op"] for e in recorder.events]
    assert {"on_worker_lost", "cancel_step"} <= set(ops)
    assert any(d["op"] == "cancel_step" and d["removed"] for d in recorded)
    assert any(a["is_migration"] for d in recorded for a in d.get("assignments", ()))
    events = json.loads(json.dumps(recorder.events))
    mismatches: list[str] = []
    assert replay(events, make_policy("rhymerl", chunk_size=4), mismatches) == recorded
    assert mismatches == []


# --- the live scheduler -----------------------------------------------------------------
@pytest.mark.timeout(600)
def test_live_scheduler_decisions_replay_identically(tmp_path, redis_url):
    """A real scheduler with two CPU workers records its policy calls while two steps
    run (the second with history from the first); a fresh rhymerl policy fed the same
    calls makes every decision the live one made."""
    from rhymerl import Prompt, RolloutClient, SamplingParams

    from tests.e2e.cluster import Cluster, save_tiny_model

    path = tmp_path / "live_events.jsonl"
    cluster = Cluster(model_dir=save_tiny_model(tmp_path / "tiny"), redis_url=redis_url, num_workers=2,
                      policy="rhymerl", chunk_tokens=8, speculative=False,
                      scheduler_settings={"record_events": str(path)}).start()
    prompts = [Prompt(f"rp{i}", [2 + (5 * i + 3 * j) % 90 for j in range(6)]) for i in range(4)]
    sampling = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, max_tokens=24, seed=11)
    try:
        assert isinstance(cluster.scheduler.core.policy, EventRecorder)
        with RolloutClient(cluster.address, timeout_s=120, max_retries=2) as client:
            for step in ("replay-1", "replay-2"):
                result = client.rollout(step, prompts, n=3, sampling=sampling)
                assert len(result.samples) == 12
    finally:
        cluster.stop()
    events = read_events(path)
    assert events[0]["op"] == "start" and events[0]["config"]["chunk_size"] == 8
    assert sum(e["op"] == "add_step" for e in events) == 2
    assert any(e["lengths"]["history"] for e in events if e["op"] == "add_step")  # step 2 had history
    recorded = decisions_of(events)
    assignments = [a for d in recorded for a in d["assignments"]]
    assert len({tuple(a["request"]) for a in assignments}) == 24
    assert len({a["worker_id"] for a in assignments}) == 2
    mismatches: list[str] = []
    assert replay(events, make_policy("rhymerl", chunk_size=8), mismatches) == recorded
    assert mismatches == []
