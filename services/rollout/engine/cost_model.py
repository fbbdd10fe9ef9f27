"""Forward cost as a function of tokens per forward, and the draft budget it implies.

A decode forward is bound by reading the weights, so up to a few hundred tokens per
forward cost about the same as one (docs/cost-model.md, H100 table below). The draft budget of a
step is the number of extra tokens that keep the forward within ``tolerance`` of a
one-token forward: long drafts when few sequences decode, none when the batch alone
fills the flat part of the curve. Optionally the curve is re-measured on the fly from
the engine's own step times (``observe``), which replaces the table once enough token
buckets have samples.

This module knows nothing about sequences or drafters.
"""

from __future__ import annotations

import bisect
import math

# One H100, bf16, CUDA graphs, weight matrices only: (tokens per forward, ms).
H100_CURVES: dict[str, tuple[tuple[int, float], ...]] = {
    "0.5B": ((1, 0.66), (32, 0.70), (128, 0.82), (256, 0.93), (512, 1.12)),
    "1.5B": ((1, 1.44), (32, 1.49), (128, 1.59), (256, 1.95), (512, 2.94)),
    "7B": ((1, 5.13), (32, 5.20), (128, 5.59), (256, 6.62), (512, 11.9)),
}
_CURVE_PARAMS = {"0.5B": 0.5e9, "1.5B": 1.5e9, "7B": 7e9}
_MEASURE_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048)


class CostModel:
    def __init__(self, points=H100_CURVES["0.5B"], tolerance: float = 0.25, measure: bool = False,
                 min_samples: int = 5, ema: float = 0.1):
        self.points = tuple(sorted(points))
        self.tolerance = tolerance
        self.measure = measure
        self.min_samples = min_samples
        self.ema = ema
        self._measured: dict[int, list[float]] = {}  # bucket -> [ema_ms, num_samples]

    @classmethod
    def for_num_params(cls, num_params: int, **kw) -> "CostModel":
        """The H100 curve (docs/cost-model.md) of the nearest model size."""
        name = min(_CURVE_PARAMS, key=lambda k: abs(_CURVE_PARAMS[k] - num_params) / _CURVE_PARAMS[k])
        return cls(H100_CURVES[name], **kw)

    def curve(self) -> tuple[tuple[int, float], ...]:
        measured = tuple((b, ms) for b, (ms, n) in sorted(self._measured.items()) if n >= self.min_samples)
        return measured if self.measure and len(measured) >= 2 else self.points

    def step_ms(self, num_tokens: int) -> float:
        """Piecewise-linear interpolation, extrapolated from the last segment."""
        pts = self.curve()
        xs = [x for x, _ in pts]
        i = min(max(bisect.bisect_left(xs, num_tokens), 1), len(pts) - 1)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return max(y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0), 1e-6)

    def flat_tokens(self) -> int:
        """The most tokens per forward costing at most (1 + tolerance) x a one-token forward."""
        limit = (1 + self.tolerance) * self.step_ms(1)
        lo, hi = 1, 1
        while self.step_ms(hi * 2) <= limit and hi < 1 << 16:
            hi *= 2
        lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.step_ms(mid) <= limit else (lo, mid)
        return lo

    def draft_budget(self, num_base_tokens: int) -> int:
        """Draft tokens that fit beside num_base_tokens for about the cost of one token."""
        return max(0, self.flat_tokens() - num_base_tokens)

    def observe(self, num_tokens: int, ms: float) -> None:
        """Feed a measured step time (only used when ``measure``)."""
        if not self.measure or num_tokens < 1:
            return
        bucket = min(_MEASURE_BUCKETS, key=lambda b: abs(math.log(num_tokens / b)))
        if abs(num_tokens - bucket) > 0.25 * bucket:
            return  # too far from every bucket: it would blur the curve
        entry = self._measured.setdefault(bucket, [ms, 0])
        entry[0] = ms if entry[1] == 0 else (1 - self.ema) * entry[0] + self.ema * ms
        entry[1] += 1
