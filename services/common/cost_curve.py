"""Time of one forward pass as a function of the tokens it carries: the H100 table of
docs/cost-model.md and the one curve class every service prices forwards with.

Piecewise-linear through measured points; below the first point it keeps the first
point's time (a decode forward is bound by reading the weights), beyond the last it keeps
the last segment's slope (compute-bound: time grows linearly with tokens). The table is
weight matrices only: attention over the KV cache is not in it. The rollout engine sizes
draft budgets on it (services/rollout/engine/cost_model.py); the scheduler's simulator
and placement policies time simulated workers with it. Knows nothing about requests,
drafts or workers.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

# tokens per forward -> ms, one H100 80GB HBM3, bf16, the weight matrices in one CUDA graph:
# benchmarks/results/nvidia-h100-80gb-hbm3/cost_probe.json (2026-11-26; docs/cost-model.md),
# made non-decreasing (7B: 5.99 ms measured at M=32 below 6.00 at M=1)
H100_CURVES: dict[str, tuple[tuple[int, float], ...]] = {
    "0.5B": ((1, 0.96), (32, 1.01), (128, 1.08), (256, 1.16), (512, 1.46)),
    "1.5B": ((1, 1.86), (32, 1.93), (128, 2.05), (256, 2.21), (512, 3.08)),
    "7B": ((1, 6.00), (32, 6.00), (128, 6.29), (256, 7.32), (512, 11.92)),
}
# the time to read the weights once at full HBM bandwidth (docs/cost-model.md)
HBM_FLOOR_MS = {"0.5B": 0.34, "1.5B": 1.06, "7B": 4.84}
_SHAPE_PARAMS = {"0.5B": 0.5e9, "1.5B": 1.5e9, "7B": 7e9}


@dataclass(frozen=True)
class CostCurve:
    num_tokens: tuple[float, ...]  # increasing
    ms: tuple[float, ...]  # forward time at each point

    def __post_init__(self) -> None:
        if len(self.num_tokens) < 2 or len(self.num_tokens) != len(self.ms):
            raise ValueError("a cost curve needs at least two (tokens, ms) points")
        if any(b <= a for a, b in zip(self.num_tokens, self.num_tokens[1:])):
            raise ValueError(f"token counts must increase: {self.num_tokens}")

    @classmethod
    def from_points(cls, points: Iterable[tuple[float, float]]) -> CostCurve:
        """A curve through (tokens per forward, ms) points, in any order."""
        pts = sorted(points)
        return cls(tuple(float(m) for m, _ in pts), tuple(float(ms) for _, ms in pts))

    @classmethod
    def h100(cls, shape: str = "7B") -> CostCurve:
        """The H100 curve (docs/cost-model.md) of a model shape: "0.5B", "1.5B" or "7B"."""
        try:
            return cls.from_points(H100_CURVES[shape])
        except KeyError:
            raise ValueError(f"unknown model shape {shape!r}; known: {sorted(H100_CURVES)}") from None

    @classmethod
    def h100_nearest(cls, num_params: int) -> CostCurve:
        """The H100 curve of the model shape nearest ``num_params`` (relative distance)."""
        return cls.h100(min(_SHAPE_PARAMS, key=lambda k: abs(_SHAPE_PARAMS[k] - num_params) / _SHAPE_PARAMS[k]))

    @classmethod
    def from_measurements(cls, samples: Iterable[tuple[int, float]]) -> CostCurve:
        """Fit a curve to (tokens per forward, ms) samples: the median per token count,
        made non-decreasing (a bigger forward is never cheaper; noise otherwise bends
        the curve the wrong way)."""
        by_tokens: dict[int, list[float]] = defaultdict(list)
        for num_tokens, ms in samples:
            if num_tokens <= 0 or ms <= 0:
                raise ValueError(f"bad measurement ({num_tokens} tokens, {ms} ms)")
            by_tokens[int(num_tokens)].append(float(ms))
        if len(by_tokens) < 2:
            raise ValueError("need measurements at two or more token counts")
        tokens = sorted(by_tokens)
        medians = itertools.accumulate((statistics.median(by_tokens[m]) for m in tokens), max)
        return cls(tuple(float(m) for m in tokens), tuple(float(x) for x in medians))

    def forward_ms(self, num_tokens: float) -> float:
        """Milliseconds of one forward over ``num_tokens`` tokens (0 tokens: no forward)."""
        if num_tokens <= 0:
            return 0.0
        xs, ys = self.num_tokens, self.ms
        if num_tokens < xs[0]:
            return ys[0]
        i = min(max(bisect.bisect_right(xs, num_tokens), 1), len(xs) - 1)  # segment [i-1, i]
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[i - 1] + slope * (num_tokens - xs[i - 1]), 1e-6)

    def forward_s(self, num_tokens: float) -> float:
        return self.forward_ms(num_tokens) / 1000.0
