"""The oracle lower bound of a GRPO step, beside which scheduler_bench and prediction_limit
report every policy: true lengths known, perfect packing. A bound, not a schedule."""

from __future__ import annotations

from services.common.cost_curve import CostCurve
from services.scheduler.length_model import LengthModel


class OracleLengths(LengthModel):
    """Knows every sample's true length: the reference no real predictor can beat."""

    def __init__(self, true_len: dict[str, int]) -> None:
        super().__init__()
        self.true_len = true_len

    def predict(self, request, use_history: bool = True) -> float:
        return float(self.true_len[request.key])


ORACLE = {"runaway_guard": float("inf")}  # rhymerl, longest true length first


def oracle_bound(step, cost: CostCurve, num_workers: int, capacity: int) -> dict:
    """The oracle lower bound of one step: true lengths known, perfect packing.

    makespan >= max(longest single request, fleet work / workers), where a request alone
    on a worker takes prefill(prompt) + length x forward(1 token) (a sequence is
    sequential: no schedule can split it), and the fleet work is every request at the
    cheapest per-token cost the curve allows: decode tokens in a full batch of
    ``capacity`` sequences, forward(capacity) / capacity each, and prompt tokens at the
    curve's smallest slope (a prefill riding in a decode forward adds at least that per
    token). The bubble bound (same
    definition as the policies': idle worker-seconds / worker-seconds) is what is left
    idle if every request ran alone on a worker for its whole length (the most busy
    worker-time a set of requests can produce): max(0, 1 - sum(alone) / (workers x
    makespan)); perfect packing can end every request at the makespan, so the tail bound
    is 0. ``idle_capacity`` is the share of the fleet's full-batch decode capacity that
    the bound leaves unused: what one unsplittable long request costs, whatever the policy.
    """
    per_token_full = cost.forward_s(capacity) / capacity
    xs, ys = cost.num_tokens, cost.ms
    min_slope_s = min((y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:])) / 1000.0
    alone, work = [], 0.0
    for request in step.requests:
        length = step.true_len[request.key]
        alone.append(cost.forward_s(request.prompt_len) + length * cost.forward_s(1))
        work += request.prompt_len * min_slope_s + length * per_token_full
    makespan = max(max(alone), work / num_workers)
    return {"policy": "oracle", "workers": num_workers, "samples": len(step.requests), "steps": 1,
            "makespan_s": makespan, "bubble_ratio": max(0.0, 1.0 - sum(alone) / (num_workers * makespan)),
            "tail_s": 0.0, "idle_capacity": max(0.0, 1.0 - work / (num_workers * makespan)),
            "longest_request_s": max(alone), "work_bound_s": work / num_workers}
