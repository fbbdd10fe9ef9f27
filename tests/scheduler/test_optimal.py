"""Each policy on tiny hand-made workloads whose best makespan is known by hand.

The setting makes the simulator's clock the textbook scheduling problem:
  - FLAT_1MS: every forward takes 1 ms whatever its size, so a worker of capacity c is
    c parallel slots each producing 1 token per ms (batching is free);
  - prompts of length 0: prefill (and a migration's re-prefill) costs no forward, so a
    request of L tokens occupies one slot for exactly L ms;
  - every request is its own prompt (n=1) with its true length as its only history,
    so the history-based policies (histopipe, rhymerl) predict every length exactly;
    seer (no history: every request is its own group's probe) and static see nothing.
Then the optimum is the multiprocessor makespan over slots: at least
max(longest request, total tokens / slots), and each workload below reaches that bound
with an explicit packing, so that bound is the optimum.
"""

from __future__ import annotations

import pytest

from services.common.cost_curve import CostCurve
from services.scheduler.length_model import LengthModel
from services.scheduler.policies import make_policy
from services.scheduler.policies.base import Request
from services.scheduler.simulator import SimStep, Simulator

FLAT_1MS = CostCurve((1.0, 512.0), (1.0, 1.0))  # every forward takes 1 ms, whatever its size

HISTORY_POLICIES = [
    ("histopipe", {}),
    ("rhymerl", {}),  # chunks of 1024 tokens: whole requests here
    ("rhymerl", {"chunk_size": 2}),  # divided rollout: every request returns to the pool
]


def known_lengths_step(lengths: list[int]) -> SimStep:
    """One request per prompt, in this arrival order; history = the true length."""
    requests = [Request("s", f"q{i}", 0, prompt_len=0, max_tokens=100)
                for i in range(len(lengths))]
    return SimStep("s", requests, {r.key: n for r, n in zip(requests, lengths)},
                   {f"q{i}": [[n]] for i, n in enumerate(lengths)})


def makespan_ms(policy: str, kw: dict, lengths: list[int], num_workers: int, capacity: int) -> float:
    result = Simulator(make_policy(policy, **kw), FLAT_1MS, num_workers, capacity, quantum_s=0.0).run(
        [known_lengths_step(lengths)], LengthModel())
    (stats,) = result.steps
    assert stats.num_samples == len(lengths)
    return round(stats.makespan_s * 1000, 6)


# (name, lengths in arrival order, workers, capacity, optimum ms, static ms, seer ms)
WORKLOADS = [
    # One long request and eight short ones on 2 x 1 slots. Bound: max(8, 16 / 2) = 8,
    # reached by {8} | {1 x 8}; longest-first + least-loaded builds exactly that.
    # static pins arrivals 0,2,4,6,8 (8+1+1+1+1 = 12) to w0 and 1,3,5,7 (4) to w1: 12.
    # seer runs in arrival order on the least-loaded worker; the 8 arrives first: 8.
    ("one_long", [8, 1, 1, 1, 1, 1, 1, 1, 1], 2, 1, 8.0, 12.0, 8.0),
    # Two long requests that round-robin puts on the same worker. Bound: max(6, 22 / 2) = 11,
    # reached by {6, 2, 2, 1} | {6, 2, 2, 1}; LPT: 6|6, then 2,2,2,2 alternate (10|10), then 1|1.
    # static: w0 gets 1,1,2,2 (6), w1 gets 6,6,2,2 (16): 16.
    # seer (arrival order, least loaded): w0 1 [0,1], 1 [1,2], 6 [2,8], 2 [8,10], 2 [10,12];
    # w1 6 [0,6], 2 [6,8], 2 [8,10]: 12.
    ("long_pair_round_robin", [1, 6, 1, 6, 2, 2, 2, 2], 2, 1, 11.0, 16.0, 12.0),
    # Three workers. Bound: max(6, 24 / 3) = 8, reached by {6, 2} | {6, 2} | {2, 2, 2, 2}.
    # static: w0 6,2,2 (10), w1 2,2,2 (6), w2 6,2 (8): 10.
    # seer: 6, 2, 6 start at 0; w1 runs two more 2s (ends 6), then each worker one 2: 8.
    ("three_workers", [6, 2, 6, 2, 2, 2, 2, 2], 3, 1, 8.0, 10.0, 8.0),
    # Capacity 2 (batching): 4 slots. Bound: max(8, 32 / 4) = 8, reached by one 8 in each
    # worker's first slot and {4, 4} in each worker's second slot.
    # static: w0 gets 8, 8, 4 (slots 8 | 8 then 4: 12), w1 gets 4, 4, 4 (8): 12.
    # seer (arrival order, least loaded): 8 and 8 land on different workers, the 4s fill
    # the second slots two by two: 8.
    ("batched", [8, 4, 8, 4, 4, 4], 2, 2, 8.0, 12.0, 8.0),
]
IDS = [w[0] for w in WORKLOADS]


@pytest.mark.parametrize("policy,kw", HISTORY_POLICIES, ids=["histopipe", "rhymerl", "rhymerl_chunked"])
@pytest.mark.parametrize("name,lengths,num_workers,capacity,optimum,static,seer", WORKLOADS, ids=IDS)
def test_history_policies_reach_the_optimum(policy, kw, name, lengths, num_workers, capacity, optimum,
                                            static, seer):
    if policy == "histopipe" and name == "batched":
        # Known gap, kept visible: histopipe estimates a worker's finish time as
        # max(tokens / capacity, longest), a bound that treats slots as perfectly
        # divisible. LPT on that estimate queues 8, 4, 4, 4 on w0 (estimate max(20/2, 8)
        # = 10 only after the third 4) and 8, 4 on w1; w0 then runs 8 | 4, 4 and the last
        # 4 after both slots free at 8: 12 ms, not 8.
        assert makespan_ms(policy, kw, lengths, num_workers, capacity) == 12.0
        return
    assert makespan_ms(policy, kw, lengths, num_workers, capacity) == optimum


@pytest.mark.parametrize("name,lengths,num_workers,capacity,optimum,static,seer", WORKLOADS, ids=IDS)
def test_static_round_robin_is_provably_worse(name, lengths, num_workers, capacity, optimum, static, seer):
    assert makespan_ms("static", {}, lengths, num_workers, capacity) == static > optimum


@pytest.mark.parametrize("name,lengths,num_workers,capacity,optimum,static,seer", WORKLOADS, ids=IDS)
def test_seer_without_history_runs_in_arrival_order(name, lengths, num_workers, capacity, optimum, static,
                                                    seer):
    """No history and one sample per prompt: every request is a probe, run in arrival
    order on the least-loaded worker (list scheduling), optimal only when the arrival
    order happens to be a good one."""
    assert makespan_ms("seer", {}, lengths, num_workers, capacity) == seer >= optimum


@pytest.mark.parametrize("policy,kw", [("static", {}), ("seer", {}), *HISTORY_POLICIES],
                         ids=["static", "seer", "histopipe", "rhymerl", "rhymerl_chunked"])
def test_longest_first_worst_case_is_seven_sixths(policy, kw):
    """Graham's example where longest-first list scheduling is not optimal: 3, 3, 2, 2, 2
    on 2 x 1 slots. Optimum {3, 3} | {2, 2, 2} = 6; longest-first puts the 3s on both
    workers, then 2, 2 (5 | 5) and the last 2 at 7. Every policy gets 7 here, rhymerl
    with 2-token chunks too: it orders by predicted total length, not remaining length,
    so the 3s keep priority (longest-remaining-first with free migration would reach 6)."""
    assert makespan_ms(policy, kw, [3, 3, 2, 2, 2], 2, 1) == 7.0
