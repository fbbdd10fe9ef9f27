"""Fair sharing of worker slots between the steps in flight (several trainers, or a
trainer's overlapping steps).

Max-min fairness: every step with work gets an equal share of the slots, a step that
needs less than its share leaves the rest to the others, and a remainder goes to the
older steps. A step never loses a chunk already running (chunks end within the chunk
budget, and the next ones respect the share), so a huge step that took the whole fleet
gives a newcomer its share within one chunk.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.scheduler.policies.base import StepQuota


def max_min_shares(num_slots: int, demands: Mapping[str, int]) -> dict[str, int]:
    """Slots per step (``demands`` in step arrival order): no step above its demand,
    every step at least min(demand, the equal share of what the smaller ones leave)."""
    shares, left = {}, num_slots
    pending = sorted(demands, key=lambda s: demands[s])  # stable: older first among equals
    for i, step_id in enumerate(pending):
        equal = left // (len(pending) - i)
        shares[step_id] = min(demands[step_id], equal)
        left -= shares[step_id]
    for step_id in demands:  # what rounding left over: older steps first
        if left <= 0:
            break
        extra = min(left, demands[step_id] - shares[step_id])
        shares[step_id] += extra
        left -= extra
    return shares


def step_quota(num_slots: int, running: Mapping[str, int], queued: Mapping[str, int]) -> StepQuota | None:
    """How many chunks each step with queued work may start now; None when at most one
    step has queued work (it may take every free slot: nothing to share)."""
    waiting = [s for s in queued if queued[s] > 0]
    if len(waiting) <= 1:
        return None
    demands = {s: running.get(s, 0) + queued.get(s, 0) for s in dict.fromkeys([*running, *queued])}
    shares = max_min_shares(num_slots, demands)
    return StepQuota({s: max(0, shares[s] - running.get(s, 0)) for s in waiting})
