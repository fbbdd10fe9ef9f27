"""Forward cost as a function of tokens per forward, and the draft budget it implies.

A decode forward is bound by reading the weights, so up to a few hundred tokens per
forward cost about the same as one (the H100 table in services/common/cost_curve.py). The draft budget of a
step is the number of extra tokens that keep the forward within ``tolerance`` of a
one-token forward: long drafts when few sequences decode, none when the batch alone
fills the flat part of the curve. Optionally the curve is re-measured on the fly from
the engine's own step times (``observe``; wall time on a GPU, CPU time on a CPU: see
``engine.cost_clock``), which replaces the table once enough token buckets have samples.

This module knows nothing about sequences or drafters.
"""

from __future__ import annotations

import math

from services.common.cost_curve import H100_CURVES, CostCurve

_MEASURE_BUCKETS = (1, 8, 32, 64, 128, 256, 512, 1024, 2048)


class CostModel:
    def __init__(self, points=H100_CURVES["0.5B"], tolerance: float = 0.25, measure: bool = False,
                 min_samples: int = 5, ema: float = 0.1):
        self.prior = CostCurve.from_points(points)
        self.tolerance = tolerance
        self.measure = measure
        self.min_samples = min_samples
        self.ema = ema
        self._measured: dict[int, list[float]] = {}  # bucket -> [ema_ms, num_samples]
        # Bumped whenever the measured curve may have changed (what caches of it key on).
        self.version = 0
        self._curve: tuple[int, CostCurve] | None = None
        self._flat: tuple[tuple[int, float], int] | None = None

    @classmethod
    def for_num_params(cls, num_params: int, **kw) -> "CostModel":
        """The H100 curve (docs/cost-model.md) of the nearest model size."""
        prior = CostCurve.h100_nearest(num_params)
        return cls(zip(prior.num_tokens, prior.ms), **kw)

    def curve(self) -> CostCurve:
        """The measured curve once two buckets have enough samples, else the H100 prior
        (built once per `version`: the engine and the drafter read it several times a step)."""
        cached = self._curve
        if cached is not None and cached[0] == self.version:
            return cached[1]
        measured = [(b, ms) for b, (ms, n) in sorted(self._measured.items()) if n >= self.min_samples]
        curve = CostCurve.from_points(measured) if self.measure and len(measured) >= 2 else self.prior
        self._curve = (self.version, curve)
        return curve

    def step_ms(self, num_tokens: int) -> float:
        return self.curve().forward_ms(num_tokens)

    def flat_tokens(self) -> int:
        """The most tokens per forward costing at most (1 + tolerance) x a one-token forward
        (searched once per curve: the engine asks every step)."""
        cached = self._flat
        if cached is not None and cached[0] == (self.version, self.tolerance):
            return cached[1]
        flat = self._search_flat_tokens()
        self._flat = ((self.version, self.tolerance), flat)
        return flat

    def _search_flat_tokens(self) -> int:
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
        self.version += 1
