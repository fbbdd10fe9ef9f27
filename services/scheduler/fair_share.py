"""Fair sharing of worker slots between the steps in flight (several trainers, or a
trainer's overlapping steps).

Max-min fairness: every step with work gets an equal share of the slots, a step that
needs less than its share leaves the rest to the others, and a remainder goes to the
older steps. A step never loses a chunk already running (chunks end within the chunk
budget, and the next ones respect the share), so a huge step that took the whole fleet
gives a newcomer its share within one chunk.

Three modes (the scheduler's ``fair_share`` setting), from most throughput to most
latency protection:
  - ``work_conserving``: a step may take every slot the others do not need, so the fleet
    stays full. Beside a huge step a small one gets the slots it needs, but every
    worker's batch stays full of the huge step's sequences, and where a step's cost
    grows with the batch (a CPU; a GPU past its memory-bound batch sizes) the small
    step's tokens are computed in the slowest batches.
  - ``equal``: while several steps have unfinished samples, none runs more chunks than
    an equal split of the slots (the older steps get a remainder); the share a small
    step leaves unused stays free.
  - ``matched`` (the default): ``equal``, and no step runs more chunks than the largest
    other running step has samples: beside a 16-sample step a huge one runs 16 chunks at
    a time, so the small step's batches are about twice its own, not the fleet's (its
    time stays within a few times its time alone), while the huge step's throughput
    drops to that many sequences until the small step ends. Steps of similar size get
    an equal split, as in ``equal``.
A step alone takes every slot in every mode.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.scheduler.policies.base import StepQuota


def max_min_shares(num_slots: int, demands: Mapping[str, int]) -> dict[str, int]:
    """Slots per step (``demands`` in step arrival order): equal rounds, no step above its
    demand; slots fewer than the steps still wanting go to the older ones."""
    shares = dict.fromkeys(demands, 0)
    left, wanting = num_slots, [s for s in demands if demands[s] > 0]
    while left > 0 and wanting:
        equal = left // len(wanting)
        if equal == 0:
            for step_id in wanting[:left]:
                shares[step_id] += 1
            break
        for step_id in wanting:
            give = min(equal, demands[step_id] - shares[step_id])
            shares[step_id] += give
            left -= give
        wanting = [s for s in wanting if shares[s] < demands[s]]
    return shares


MODES = ("matched", "equal", "work_conserving")


def step_quotas(num_slots: int, running: Mapping[str, int], queued: Mapping[str, int], mode: str = "matched",
                sizes: Mapping[str, int] | None = None) -> list[tuple[str, StepQuota]] | None:
    """Per step with queued work, the chunks it may start now, most starved step first
    (running / share): the caller places them one step at a time, so a step whose
    requests wait on particular workers (pinned policies) gets those workers' free slots
    before a step above its share does. None when nothing is to be shared: at most one
    step has queued work (``work_conserving``: it may take every free slot), or one step
    has unfinished samples at all (the other modes). ``sizes``: each step's number of
    samples (``matched``; a step missing counts as its demand)."""
    if mode not in MODES:
        raise ValueError(f"fair share mode must be one of {MODES}, got {mode!r}")
    demands = {s: running.get(s, 0) + queued.get(s, 0) for s in dict.fromkeys([*running, *queued])}
    waiting = [s for s in queued if queued[s] > 0]
    if mode != "work_conserving":
        live = [s for s in demands if demands[s] > 0]
        if len(live) <= 1:
            return None
        shares = max_min_shares(num_slots, dict.fromkeys(live, num_slots))  # the equal split
        if mode == "matched":
            size = {s: max(demands[s], (sizes or {}).get(s, 0)) for s in live}
            shares = {s: min(shares[s], max(size[o] for o in live if o != s)) for s in live}
        shares = {s: min(demands[s], shares.get(s, 0)) for s in demands}
    elif len(waiting) <= 1:
        return None
    else:
        shares = max_min_shares(num_slots, demands)
    order = sorted(waiting, key=lambda s: running.get(s, 0) / max(1, shares[s]))  # stable: older first
    return [(s, StepQuota({s: shares[s] - running.get(s, 0)})) for s in order if shares[s] > running.get(s, 0)]
