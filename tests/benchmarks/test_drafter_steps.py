"""benchmarks.drafter_steps: a log of the engine's drafter calls replays into a fresh
drafter with the same drafts (no model needed: the calls are made here)."""

from __future__ import annotations

import sys

from benchmarks import drafter_steps as S


def test_recorded_calls_replay_with_the_same_drafts():
    _, history = S._history()
    recorder = S._Recorder(S._drafter(history))
    prompt_ids = list(history)[:3]
    ids = [f"r{i}" for i in range(6)]
    for i, rid in enumerate(ids):
        recorder.start_request(rid, prompt_ids[i % 3], [1, 2, 3])
    for step in range(20):
        drafts = recorder.propose(ids, [16] * len(ids), [frozenset({2})] * len(ids), budget=8)
        if step % 2:  # the engine's one call per step
            tokens = [t for draft in drafts for t in draft[:len(draft) // 2] + [7]]
            recorder.commit_step(ids, [len(d) for d in drafts], [len(d) // 2 for d in drafts], tokens,
                                 [len(d) // 2 + 1 for d in drafts])
            continue
        for rid, draft in zip(ids, drafts):  # calls one by one (a log of an older engine)
            if draft:
                recorder.record_acceptance(rid, len(draft), len(draft) // 2)
            recorder.add_tokens(rid, draft[:len(draft) // 2] + [7])
    for rid in ids:
        recorder.stop_request(rid)
    drafted = sum(len(draft) for name, _, _, out in recorder.log if name == "propose" for draft in out)
    assert drafted > 0  # the replay compares something
    for backend in ("python", "compiled"):
        steps, per_method, mismatches, pauses = S.replay(recorder.log, backend)
        assert mismatches == 0, backend
        assert len(steps) == 20 and all(n == len(ids) for n, _, _ in steps)
        assert set(per_method) == set(S._CALLS)


def test_replay_of_a_batched_log_makes_no_flush_call(monkeypatch):
    """Every commit of a log replayed into a drafter with commit_step is one commit_step,
    applied in its own call, and an engine calls no flush: the replay must not time one
    (an empty flush's span cost a clock read per step, about 0.7 µs of a one-sequence step)."""
    from services.rollout.drafter.compiled import CompiledDrafter

    _, history = S._history()
    recorder = S._Recorder(S._drafter(history, "compiled"))
    prompt_id = next(iter(history))
    recorder.start_request("r", prompt_id, [1, 2, 3])
    for _ in range(3):
        (draft,) = recorder.propose(["r"], [16], [frozenset({2})])
        recorder.commit_step(["r"], [len(draft)], [0], [7], [1])
    recorder.stop_request("r")
    callers = []
    flush = CompiledDrafter.flush

    def spy(self):
        callers.append(sys._getframe(1).f_code.co_name)
        return flush(self)

    monkeypatch.setattr(CompiledDrafter, "flush", spy)
    steps, _, mismatches, _ = S.replay(recorder.log, "compiled")
    assert mismatches == 0 and len(steps) == 3
    assert "replay" not in callers
