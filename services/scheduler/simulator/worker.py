"""A simulated rollout worker: a continuous batch whose step time is the cost model's.

All running sequences advance together, so one number per worker (``progress``: tokens
each running sequence has generated since the worker started) places every sequence;
a chunk ends when ``progress`` reaches its target. Between events the running set is
fixed, so time maps to progress linearly. Admissions stall the batch for their
prefill (a migrated chunk re-prefills its prompt and generated tokens; a chunk that
resumes where it ran hits its prefix cache). Attention time over the KV cache is not
modelled (the docs/cost-model.md curves are weight matrices only).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from services.common.cost_curve import CostCurve
from services.scheduler.policies.base import Request, RequestKey, WorkerState


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: each draft token is accepted with probability ``alpha``
    (independently); the draft length per sequence is chosen per batch size to minimise
    time per generated token on the cost curve, up to ``max_draft``."""

    alpha: float
    max_draft: int = 16

    @staticmethod
    def alpha_from_mean_accepted(mean_accepted: float, num_draft: int) -> float:
        """The alpha giving ``mean_accepted`` tokens per verify step (bonus included)
        with ``num_draft`` draft tokens: solves (1 - a^(k+1)) / (1 - a) = m."""
        if not 1.0 <= mean_accepted <= num_draft + 1:
            raise ValueError(f"mean accepted {mean_accepted} outside [1, {num_draft + 1}]")
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if sum(mid ** i for i in range(num_draft + 1)) < mean_accepted:
                lo = mid
            else:
                hi = mid
        return lo


class SpeedCurve:
    """Tokens per second of each running sequence, by batch size (cached)."""

    def __init__(self, cost: CostCurve, spec: SpecConfig | None = None) -> None:
        self.cost, self.spec = cost, spec
        self._rate: dict[int, float] = {}

    def per_sequence_rate(self, batch_size: int) -> float:
        rate = self._rate.get(batch_size)
        if rate is None:
            rate = self._rate[batch_size] = self._best_rate(batch_size)
        return rate

    def _best_rate(self, n: int) -> float:
        if self.spec is None:
            return 1.0 / self.cost.forward_s(n)
        alpha, best = self.spec.alpha, 0.0
        for k in range(self.spec.max_draft + 1):
            accepted = sum(alpha ** i for i in range(k + 1))  # expected tokens per verify step
            best = max(best, accepted / self.cost.forward_s(n * (k + 1)))
        return best

    def prefill_s(self, num_decoding: int, num_prefill_tokens: int) -> float:
        """Extra time a step takes when it also prefills ``num_prefill_tokens``."""
        return self.cost.forward_s(num_decoding + num_prefill_tokens) - self.cost.forward_s(num_decoding)


@dataclass
class Chunk:
    request: Request
    budget: int
    num_tokens: int  # what it will generate: min(budget, tokens left to its true end)
    end_progress: float
    started_s: float


class SimWorker:
    def __init__(self, state: WorkerState, speed: SpeedCurve) -> None:
        self.state, self.speed = state, speed
        self.progress = 0.0  # tokens per running sequence since start
        self.ref_s = 0.0  # time at which ``progress`` holds (later than now while stalled)
        self.version = 0  # bumps whenever the next-event time may change
        self.chunks: dict[str, Chunk] = {}
        self._ends: list[tuple[float, int, RequestKey]] = []  # (end_progress, seq, request key)
        self._seq = itertools.count()

    @property
    def worker_id(self) -> str:
        return self.state.worker_id

    def advance(self, now: float) -> None:
        if now > self.ref_s and self.chunks:
            self.progress += (now - self.ref_s) * self.speed.per_sequence_rate(len(self.chunks))
        self.ref_s = max(self.ref_s, now)

    def admit(self, request: Request, budget: int, num_tokens: int, reprefill: bool, now: float) -> None:
        self.advance(now)
        prefill_tokens = request.prompt_len + (request.num_generated if reprefill else 0)
        if reprefill or request.num_chunks == 1:
            self.ref_s += self.speed.prefill_s(len(self.chunks), prefill_tokens)
        end = self.progress + num_tokens
        self.chunks[request.key] = Chunk(request, budget, num_tokens, end, now)
        self.state.running[request.key] = request
        heapq.heappush(self._ends, (end, next(self._seq), request.key))
        self.version += 1

    def next_event_s(self) -> float | None:
        if not self._ends:
            return None
        end = self._ends[0][0]
        return self.ref_s + max(0.0, end - self.progress) / self.speed.per_sequence_rate(len(self.chunks))

    def pop_done(self, now: float) -> list[Chunk]:
        """Chunks whose tokens are all generated by ``now``."""
        self.advance(now)
        done = []
        while self._ends and self._ends[0][0] <= self.progress + 1e-6:
            _, _, key = heapq.heappop(self._ends)
            chunk = self.chunks.pop(key)
            del self.state.running[key]
            done.append(chunk)
        if done:
            self.version += 1
        return done

    def lose_all(self) -> list[Request]:
        lost = [chunk.request for chunk in self.chunks.values()]
        self.chunks.clear()
        self._ends.clear()
        self.state.running.clear()
        self.version += 1
        return lost
