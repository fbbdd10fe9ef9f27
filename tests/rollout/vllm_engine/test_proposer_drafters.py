"""The vLLM proposer (HistoryProposer) on both drafters, without vLLM: its model runner's
calls replayed by hand. If these fail, RHYMERL_WORKER_DRAFTER does not reach the proposer,
the compiled drafter drafts otherwise than the reference inside vLLM's lifecycle (resumed
context, per-step commits, acceptance, requests leaving the batch), or a failing drafter
costs a sample instead of drafts."""

from __future__ import annotations

import random
import types

import pytest

from services.rollout.drafter import HistoDrafter
from services.rollout.drafter.compiled import CompiledDrafter
from services.rollout.vllm_engine.proposer import HistoryProposer, Registration

K = 4


def _config():
    return types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=K))


class _Runner:
    def __init__(self) -> None:
        self.input_batch = types.SimpleNamespace(req_ids=[])


@pytest.mark.parametrize("kind, cls", [("compiled", CompiledDrafter), ("python", HistoDrafter)])
def test_the_setting_picks_the_proposers_drafter(monkeypatch, kind, cls):
    monkeypatch.setenv("RHYMERL_WORKER_DRAFTER", kind)
    assert isinstance(HistoryProposer(_config()).drafter, cls)


def _run(kind: str, monkeypatch, seed: int = 0) -> list:
    """vLLM's calls for a few requests over many steps: drafts checked against a hidden
    truth (accepted while they match), the context grown by the accepted tokens + one."""
    monkeypatch.setenv("RHYMERL_WORKER_DRAFTER", kind)
    rng = random.Random(seed)
    proposer = HistoryProposer(_config())
    proposer.runner = _Runner()
    pattern = [rng.randrange(20) for _ in range(12)]
    truth = {f"q{i}": [5, 6, 7] + (pattern * 12)[i:i + 80] for i in range(4)}
    for i, rid in enumerate(truth):
        proposer.register(rid, Registration("p", prompt_len=3, end_len=83, stop_token_ids=frozenset({99})))
    proposer.drafter.load_history("p", [pattern * 5])
    context = {rid: t[:3 + (5 if rid == "q3" else 0)] for rid, t in truth.items()}  # q3 resumes a chunk
    last = {rid: [] for rid in truth}
    out = []
    for step in range(40):
        live = [rid for rid in truth if len(context[rid]) < len(truth[rid])]
        if step == 20:
            live = live[1:]  # one leaves the batch (aborted / preempted)
        proposer.runner.input_batch.req_ids = live
        sampled = [last[rid] for rid in live]
        drafts = proposer.propose(sampled, [len(context[rid]) for rid in live],
                                  [list(context[rid]) + [0] * 100 for rid in live])
        out.append(drafts)
        for rid, draft in zip(live, drafts):
            t, n = truth[rid], len(context[rid])
            accepted = 0
            while accepted < len(draft) and n + accepted < len(t) and draft[accepted] == t[n + accepted]:
                accepted += 1
            new = t[n:n + accepted + 1]
            context[rid] += new
            last[rid] = new
    return out


def test_compiled_and_python_proposers_draft_alike(monkeypatch):
    compiled, python = _run("compiled", monkeypatch), _run("python", monkeypatch)
    assert compiled == python
    assert sum(len(d) for step in compiled for d in step) > 40  # it really drafted


def test_a_failing_drafter_costs_the_step_its_drafts_not_the_sample(monkeypatch):
    monkeypatch.setenv("RHYMERL_WORKER_DRAFTER", "compiled")
    proposer = HistoryProposer(_config())
    proposer.runner = _Runner()
    proposer.register("a", Registration("p", prompt_len=2, end_len=50, stop_token_ids=frozenset()))
    proposer.runner.input_batch.req_ids = ["a"]
    proposer.propose([[]], [2], [[1, 2, 0, 0]])

    def broken(*args, **kwargs):
        raise RuntimeError("injected drafter bug")
    monkeypatch.setattr(proposer.drafter, "propose", broken)
    assert proposer.propose([[3]], [3], [[1, 2, 3, 0]]) == [[]]
