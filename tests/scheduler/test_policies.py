"""Every policy against the caller's contract: nothing lost, nothing duplicated, chunk
budgets within what is left, capacity respected, under random event orders, worker
losses and cancellations. A failure here means the live scheduler could drop or
repeat a sample."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.length_model import LengthModel
from services.scheduler.policies import POLICIES, make_policy
from services.scheduler.policies.base import Request, WorkerState

POLICY_CONFIGS = [
    ("static", {}),
    ("seer", {"chunk_size": 7}),
    ("histopipe", {}),
    ("rhymerl", {"chunk_size": 5}),
    ("rhymerl", {"chunk_size": 6, "cross_step": True}),
    ("rhymerl", {"chunk_size": 5, "share_order": "spt"}),
]


def make_requests(step_id: str, num_prompts: int, n: int, max_tokens: int) -> list[Request]:
    return [Request(step_id, f"p{p}", i, prompt_len=10, max_tokens=max_tokens)
            for p in range(num_prompts) for i in range(n)]


class Harness:
    """Plays the caller: applies assignments and checks every invariant after each event."""

    def __init__(self, policy, num_workers: int, capacity: int, lengths: LengthModel) -> None:
        self.policy, self.lengths = policy, lengths
        self.workers = [WorkerState(f"w{i}", capacity) for i in range(num_workers)]
        self.by_id = {w.worker_id: w for w in self.workers}
        self.true_len: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.budgets: dict[str, int] = {}
        self.finished: list[str] = []
        self.cancelled: set[str] = set()
        self.now = 0.0

    def add_step(self, requests: list[Request], rng: random.Random) -> None:
        for r in requests:
            self.requests[r.key] = r
            self.true_len[r.key] = rng.randint(1, r.max_tokens)
        self.policy.add_step(requests, self.lengths, self.now)
        self.schedule()

    def running(self) -> list[tuple[WorkerState, Request]]:
        return [(w, r) for w in self.workers for r in w.running.values()]

    def schedule(self) -> None:
        self.now += 1.0
        for a in self.policy.schedule(self.workers, self.now):
            worker, r = self.by_id[a.worker_id], a.request
            assert worker.healthy and worker.free > 0, "over-filled or dead worker"
            assert all(r.key not in w.running for w in self.workers), "duplicate dispatch"
            assert r.key not in self.finished and r.key not in self.cancelled
            assert 1 <= a.max_new_tokens <= r.max_tokens - r.num_generated, "chunk over budget"
            worker.running[r.key] = r
            self.budgets[r.key] = a.max_new_tokens
        self.check()

    def complete(self, pick: int) -> None:
        running = self.running()
        if not running:
            return
        worker, r = running[pick % len(running)]
        del worker.running[r.key]
        new = min(self.budgets[r.key], self.true_len[r.key] - r.num_generated)
        finished = r.num_generated + new == self.true_len[r.key]
        self.policy.on_chunk_done(r, worker.worker_id, new, finished, self.now)
        if finished:
            assert r.key not in self.finished, "finished twice"
            self.finished.append(r.key)
        self.schedule()

    def lose(self, pick: int) -> None:
        healthy = [w for w in self.workers if w.healthy]
        if len(healthy) <= 1:
            return
        worker = healthy[pick % len(healthy)]
        worker.healthy = False
        lost = list(worker.running.values())
        worker.running.clear()
        self.policy.on_worker_lost(worker.worker_id, lost, self.now)
        self.schedule()

    def revive(self) -> None:
        for w in self.workers:
            w.healthy = True
        self.schedule()

    def cancel(self, step_id: str) -> None:
        running = {r.key for _, r in self.running()}
        queued = {rid for rid, r in self.requests.items() if r.step_id == step_id and rid not in running
                  and rid not in self.finished and rid not in self.cancelled}
        removed = self.policy.cancel_step(step_id)
        ids = [r.key for r in removed]
        assert sorted(ids) == sorted(queued), "cancel_step must return exactly the step's queued requests"
        for w in self.workers:  # the caller aborts the step's running chunks
            for rid in [rid for rid, r in w.running.items() if r.step_id == step_id]:
                del w.running[rid]
                ids.append(rid)
        self.cancelled.update(rid for rid, r in self.requests.items()
                              if r.step_id == step_id and rid not in self.finished)
        assert not set(ids) & set(self.finished)
        self.schedule()

    def check(self) -> None:
        running = {r.key for _, r in self.running()}
        live = {rid for rid, r in self.requests.items()
                if rid not in self.finished and rid not in self.cancelled}
        assert running <= live
        assert self.policy.num_queued() == len(live - running), "a request was lost or duplicated"

    def drain(self, rng: random.Random) -> None:
        self.revive()
        for _ in range(100_000):
            if not self.running():
                break
            self.complete(rng.randrange(1 << 30))
        live = {rid for rid in self.requests if rid not in self.cancelled}
        assert sorted(self.finished) == sorted(live), "not every sample came back exactly once"
        assert self.policy.num_queued() == 0
        for rid in self.finished:
            assert self.requests[rid].num_generated == self.true_len[rid]


ops = st.lists(st.tuples(st.sampled_from(["done", "done", "done", "lose", "revive", "cancel", "step"]),
                         st.integers(0, 1 << 20)), max_size=60)


@pytest.mark.parametrize("name,kwargs", POLICY_CONFIGS, ids=lambda x: str(x))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, seed=st.integers(0, 1000), num_workers=st.integers(1, 4), capacity=st.integers(1, 3))
def test_policy_never_loses_or_duplicates_a_request(name, kwargs, ops, seed, num_workers, capacity):
    """Random chunk completions, worker losses, revivals, cancellations and new steps:
    every sample of every uncancelled step finishes exactly once, at its true length."""
    if name not in POLICIES:
        pytest.skip(f"{name} not built yet")
    rng = random.Random(seed)
    history = {f"p{p}": [[rng.randint(1, 30) for _ in range(3)]] for p in range(0, 3, 2)}
    harness = Harness(make_policy(name, **kwargs), num_workers, capacity, LengthModel(history))
    num_steps = 1
    harness.add_step(make_requests("s0", 3, 3, max_tokens=30), rng)
    for op, arg in ops:
        if op == "done":
            harness.complete(arg)
        elif op == "lose":
            harness.lose(arg)
        elif op == "revive":
            harness.revive()
        elif op == "cancel":
            harness.cancel(f"s{arg % num_steps}")
        elif num_steps < 4:
            harness.add_step(make_requests(f"s{num_steps}", 2, 3, max_tokens=30), rng)
            num_steps += 1
    harness.drain(rng)


def test_seer_runs_one_probe_per_group_first_then_longest_group():
    """Seer's order: probes (one per group) before any sibling; afterwards the group whose
    finished sample was longest goes first. Breaks if the probe tier is skipped."""
    policy = make_policy("seer", chunk_size=100)
    worker = WorkerState("w0", capacity=2)
    requests = make_requests("s", 2, 3, max_tokens=100)
    policy.add_step(requests, LengthModel(), 0.0)
    first = policy.schedule([worker], 0.0)
    assert sorted(a.request.key for a in first) == [("s", "p0", 0), ("s", "p1", 0)]
    assert all(a.request.is_probe for a in first)
    short, long_ = first[0].request, first[1].request
    policy.on_chunk_done(short, "w0", 10, True, 1.0)  # p0's probe: 10 tokens
    policy.on_chunk_done(long_, "w0", 50, True, 2.0)  # p1's probe: 50 tokens
    order = []
    while policy.num_queued():
        for a in policy.schedule([WorkerState("w1", 1)], 3.0):
            order.append(a.request)
    assert [r.prompt_id for r in order] == ["p1", "p1", "p0", "p0"]
    assert [r.predicted_len for r in order] == [50, 50, 10, 10]


def test_seer_probes_resume_shortest_generated_first():
    """Among probes, the one with the fewest generated tokens runs first (Seer)."""
    policy = make_policy("seer", chunk_size=4)
    requests = make_requests("s", 2, 2, max_tokens=100)
    policy.add_step(requests, LengthModel(), 0.0)
    worker = WorkerState("w0", capacity=2)
    a, b = (x.request for x in policy.schedule([worker], 0.0))
    policy.on_chunk_done(a, "w0", 4, False, 1.0)
    policy.on_chunk_done(b, "w0", 2, False, 1.0)  # stopped early: fewer tokens
    nxt = policy.schedule([WorkerState("w1", 1)], 2.0)
    assert nxt[0].request is b and nxt[0].max_new_tokens == 4 and nxt[0].is_migration


def test_chunk_budget_is_capped_by_remaining_tokens():
    policy = make_policy("seer", chunk_size=8)
    (request,) = make_requests("s", 1, 1, max_tokens=10)
    policy.add_step([request], LengthModel(), 0.0)
    (a,) = policy.schedule([WorkerState("w0", 1)], 0.0)
    assert a.max_new_tokens == 8
    policy.on_chunk_done(request, "w0", 8, False, 1.0)
    (b,) = policy.schedule([WorkerState("w0", 1)], 1.0)
    assert b.max_new_tokens == 2 and not b.is_migration and request.num_chunks == 2


def test_static_pins_groups_round_robin_and_never_steals():
    """The baseline (veRL's split): each prompt's group goes round-robin to one worker,
    whole budgets, an idle worker stays idle."""
    policy = make_policy("static")
    requests = make_requests("s", 3, 2, max_tokens=50)  # p0: w0, p1: w1, p2: w0
    policy.add_step(requests, LengthModel(), 0.0)
    workers = [WorkerState("w0", 1), WorkerState("w1", 1)]
    first = policy.schedule(workers, 0.0)
    assert [(a.request.key, a.worker_id, a.max_new_tokens) for a in first] == \
        [(("s", "p0", 0), "w0", 50), (("s", "p1", 0), "w1", 50)]
    for a in first:
        workers[int(a.worker_id[1])].running[a.request.key] = a.request
    workers[1].running.clear()
    policy.on_chunk_done(first[1].request, "w1", 5, True, 1.0)
    second = policy.schedule(workers, 1.0)
    assert [(a.request.key, a.worker_id) for a in second] == [(("s", "p1", 1), "w1")]
    workers[1].running.clear()
    policy.on_chunk_done(second[0].request, "w1", 5, True, 2.0)
    assert policy.schedule(workers, 2.0) == []  # w1 is idle; p0 and p2 wait for w0
    assert policy.num_queued() == 3


def test_make_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown scheduling policy"):
        make_policy("fifo")


@pytest.mark.parametrize("name", ["static", "seer", "histopipe", "rhymerl"])
def test_late_and_repeated_results_are_ignored(name):
    """A result that arrives twice, or after its step was cancelled, must not re-queue
    or double-count a sample (the live scheduler may see both after a reconnect)."""
    policy = make_policy(name)
    requests = make_requests("s", 1, 2, max_tokens=50) + make_requests("t", 1, 1, max_tokens=50)
    policy.add_step(requests[:2], LengthModel(), 0.0)
    policy.add_step(requests[2:], LengthModel(), 0.0)
    running = [a.request for a in policy.schedule([WorkerState("w0", 3)], 0.0)]
    assert len(running) == 3 and policy.num_queued() == 0
    first = next(r for r in running if r.step_id == "s")
    policy.on_chunk_done(first, "w0", 50, True, 1.0)
    policy.on_chunk_done(first, "w0", 50, True, 1.0)
    assert first.num_generated == 50
    policy.cancel_step("t")
    late = next(r for r in running if r.step_id == "t")
    policy.on_chunk_done(late, "w0", 5, False, 2.0)
    policy.on_worker_lost("w0", [late], 2.0)
    assert policy.num_queued() == 0 and late.num_generated == 0


def _sharing_step(policy, max_tokens: int = 1000):
    """Two prompts whose history hides runaways (1 in 21 samples ran to the cap): rhymerl
    runs the step in sharing mode; ``a`` is predicted shorter than ``b``."""
    lengths = LengthModel({"a": [[10] * 20 + [max_tokens]], "b": [[20] * 20 + [max_tokens]]})
    requests = [Request("s", p, i, prompt_len=10, max_tokens=max_tokens)
                for p in ("a", "b") for i in range(16)]
    policy.add_step(requests, lengths, 0.0)
    return requests


@pytest.mark.parametrize("order, first_prompt, keeps_running", [("las", "b", False), ("spt", "a", True)])
def test_rhymerl_sharing_order(order, first_prompt, keeps_running):
    """``las``: fewest generated tokens first (longest predicted on ties), so a request
    that ran a chunk waits for the rest; ``spt``: a started request keeps its slot, new
    ones start shortest predicted first."""
    policy = make_policy("rhymerl", chunk_size=4, share_order=order)
    _sharing_step(policy)
    scouts = policy.schedule([WorkerState("w0", 2)], 0.0)  # each group's first sample goes first
    assert sorted(a.request.key for a in scouts) == [("s", "a", 0), ("s", "b", 0)]
    for a in scouts:
        policy.on_chunk_done(a.request, "w0", 4, True, 0.5)
    worker = WorkerState("w0", 1)
    (first,) = policy.schedule([worker], 0.0)
    assert first.request.prompt_id == first_prompt
    worker.running[first.request.key] = first.request
    del worker.running[first.request.key]
    policy.on_chunk_done(first.request, "w0", 4, False, 1.0)
    (second,) = policy.schedule([worker], 1.0)
    assert (second.request is first.request) == keeps_running


def test_rhymerl_rejects_unknown_share_order():
    with pytest.raises(ValueError, match="share_order"):
        make_policy("rhymerl", share_order="fifo")


def test_rhymerl_scout_that_outruns_its_history_pulls_its_group_forward():
    """Each group's first sample runs first (a scout). Prompt ``a``'s history says 10
    tokens, ``b``'s 100; ``a``'s scout comes back unfinished at 200 tokens, so the prompt
    changed: ``a``'s queued siblings must now run before ``b``'s, not after."""
    policy = make_policy("rhymerl", chunk_size=200)
    lengths = LengthModel({"a": [[10] * 16], "b": [[100] * 16]})
    requests = [Request("s", p, i, prompt_len=10, max_tokens=1000) for p in "ab" for i in range(3)]
    policy.add_step(requests, lengths, 0.0)
    scouts = policy.schedule([WorkerState("w0", 2)], 0.0)
    assert [a.request.key for a in scouts] == [("s", "b", 0), ("s", "a", 0)]  # longest predicted first
    policy.on_chunk_done(scouts[0].request, "w0", 100, True, 1.0)
    policy.on_chunk_done(scouts[1].request, "w0", 200, False, 2.0)
    order = [a.request.key for a in policy.schedule([WorkerState("w1", 5)], 2.0)]
    assert order == [("s", "a", 0), ("s", "a", 1), ("s", "a", 2), ("s", "b", 1), ("s", "b", 2)]


def test_rhymerl_learns_the_runaway_rate_for_prompts_without_history():
    """The first step knows nothing and runs as Seer does (probes, longest first); once
    finished samples show runaways (2 of 4 ran to max_tokens), a later step of new
    prompts runs in sharing mode, where every request starts early."""
    policy = make_policy("rhymerl", chunk_size=100)
    lengths = LengthModel()
    first = make_requests("s1", 1, 4, max_tokens=100)
    policy.add_step(first, lengths, 0.0)
    assert not policy._sharing["s1"]
    for a, length in zip(policy.schedule([WorkerState("w0", 4)], 0.0), (100, 100, 10, 20)):
        policy.on_chunk_done(a.request, "w0", length, True, 1.0)
    assert lengths.finished_cap_hit_rate() == 0.5
    policy.add_step(make_requests("s2", 2, 2, max_tokens=100), lengths, 2.0)
    assert policy._sharing["s2"]
