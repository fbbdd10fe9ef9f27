"""Predicts how long each response will be, from the prompt's past and its siblings.

Three sources, best first:
  1. history: the lengths the same prompt's samples had in earlier epochs (RhymeRL: only
     2-4% of responses change length rank much between epochs), newest epochs weighted
     most, plus the siblings of this step that already finished;
  2. siblings only (first epoch; Seer's context-aware rule): a group's estimate is its
     longest finished sibling, or ``max_tokens`` while none has finished;
  3. a prior (a fixed length), or ``max_tokens`` when none is given.

A request that has already generated ``g`` tokens without finishing is longer than
``g``; its prediction is conditioned on that (the weighted mean of the known lengths
above ``g``; ``max_tokens`` when it outgrew all of them), so requests that keep running
rise in priority instead of falling. With history, a request is also predicted at least
as long as the furthest any sibling has run, finished or not (Seer's longest-sibling
estimate, kept as a floor; ``observe_progress``): a group whose first sample outgrows
the prompt's history pulls its queued siblings forward.

The model knows nothing about workers or time; the caller loads history in bulk
(one round trip per step) and tells it which samples finished.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # policies import this module; it only reads Request's fields
    import numpy as np

    from services.scheduler.policies.base import Request

History = dict[str, list[list[int]]]  # prompt_id -> per epoch (newest first) the sample lengths


class _WeightedLengths:
    """Sorted lengths with suffix sums, so E[L | L > g] is one binary search."""

    def __init__(self, lengths: Sequence[float], weights: Sequence[float]) -> None:
        pairs = sorted(zip(lengths, weights))
        self.lengths = [float(length) for length, _ in pairs]
        self.cu_weight = [0.0] * (len(pairs) + 1)  # suffix sums from the end
        self.cu_weighted = [0.0] * (len(pairs) + 1)
        for i in range(len(pairs) - 1, -1, -1):
            length, weight = pairs[i]
            self.cu_weight[i] = self.cu_weight[i + 1] + weight
            self.cu_weighted[i] = self.cu_weighted[i + 1] + weight * length

    def mean_above(self, num_generated: int) -> float | None:
        i = bisect.bisect_right(self.lengths, num_generated)
        if self.cu_weight[i] <= 0.0:
            return None
        return self.cu_weighted[i] / self.cu_weight[i]


class LengthModel:
    """Per-request length predictions for one scheduler (all steps).

    Args:
        history: prompt_id -> per epoch (newest first) that epoch's sample lengths.
        prior: length assumed for a prompt with neither history nor finished siblings;
            None means ``max_tokens`` (Seer's assumption: unknown is long).
        recency: weight of epoch k (0 = newest) is ``recency ** k``.
        sibling_weight: weight of one finished sibling relative to one newest-epoch sample.
    """

    def __init__(self, history: History | None = None, *, prior: float | None = None,
                 recency: float = 0.5, sibling_weight: float = 1.0) -> None:
        self.prior = prior
        self.recency = recency
        self.sibling_weight = sibling_weight
        self._history: dict[str, _WeightedLengths] = {}
        self._raw: dict[str, list[tuple[float, float]]] = {}
        self._siblings: dict[tuple[str, str], list[int]] = defaultdict(list)
        self._progress: dict[tuple[str, str], int] = {}  # group -> most tokens any sibling reached
        self.num_finished = 0  # samples observed finishing, all steps
        self.num_capped = 0  # of those, the ones that ran to max_tokens
        self._combined: dict[tuple[str, str], _WeightedLengths] = {}
        if history:
            self.load_history(history)

    def load_history(self, history: History) -> None:
        """Replace the history of the prompts in ``history`` (others are kept)."""
        for prompt_id, epochs in history.items():
            raw = [(float(length), self.recency ** age)
                   for age, lengths in enumerate(epochs) for length in lengths]
            if raw:
                self._raw[prompt_id] = raw
                self._history[prompt_id] = _WeightedLengths(*zip(*raw))
            else:
                self._raw.pop(prompt_id, None)
                self._history.pop(prompt_id, None)
        stale = [group for group in self._combined if group[1] in history]
        for group in stale:
            del self._combined[group]

    def has_history(self, prompt_id: str) -> bool:
        return prompt_id in self._history

    def cap_hit_rate(self, prompt_id: str, max_tokens: int) -> float | None:
        """Weighted share of the prompt's past samples that ran to ``max_tokens`` (None:
        no history). Truncated runaways are what a length ranking cannot foresee."""
        raw = self._raw.get(prompt_id)
        if raw is None:
            return None
        total = sum(weight for _, weight in raw)
        return sum(weight for length, weight in raw if length >= max_tokens) / total

    def finished_cap_hit_rate(self) -> float | None:
        """Share of the samples observed finishing (all steps, all prompts) that ran to
        their ``max_tokens``; None before the first."""
        return self.num_capped / self.num_finished if self.num_finished else None

    def num_finished_siblings(self, group_id: tuple[str, str]) -> int:
        return len(self._siblings.get(group_id, ()))

    def observe(self, request: Request, length: int) -> None:
        """A sample of ``request``'s group finished with ``length`` tokens (an aborted
        one is not evidence of how long its siblings run, and is ignored)."""
        if request.aborted:
            return
        group, length = request.group_id, int(length)
        self.num_finished += 1
        self.num_capped += length >= request.max_tokens
        self._siblings[group].append(length)
        if length > self._progress.get(group, 0):
            self._progress[group] = length
        self._combined.pop(group, None)

    def observe_progress(self, request: Request) -> bool:
        """``request`` returned from a chunk unfinished: its group runs at least
        ``num_generated`` tokens. Returns whether that raised the group's floor."""
        if request.num_generated <= self._progress.get(request.group_id, 0):
            return False
        self._progress[request.group_id] = request.num_generated
        return True

    def forget_step(self, step_id: str) -> None:
        """Drop a finished step's sibling observations (history keeps the lengths)."""
        for group in [g for g in self._siblings if g[0] == step_id]:
            del self._siblings[group]
            self._combined.pop(group, None)
        for group in [g for g in self._progress if g[0] == step_id]:
            del self._progress[group]

    def predict(self, request: Request, use_history: bool = True) -> float:
        """Expected total length of ``request`` given it has not finished yet.

        ``use_history=False`` ignores earlier epochs (Seer's sibling-only estimate).
        """
        generated, cap = request.num_generated, request.max_tokens
        stats = self._stats(request) if use_history else None
        if stats is not None:
            mean = stats.mean_above(generated)
            floor = self._progress.get(request.group_id, 0)  # a sibling already ran this far
            return float(cap) if mean is None else min(max(mean, floor), float(cap))
        siblings = self._siblings.get(request.group_id)
        if siblings:
            longest = max(siblings)
            return float(longest) if longest > generated else float(cap)
        if self.prior is None:
            return float(cap)
        return float(min(cap, max(self.prior, generated + 1)))

    def _stats(self, request: Request) -> _WeightedLengths | None:
        """History plus finished siblings, or None when the prompt has no history."""
        raw = self._raw.get(request.prompt_id)
        if raw is None:
            return None
        siblings = self._siblings.get(request.group_id)
        if not siblings:
            return self._history[request.prompt_id]
        combined = self._combined.get(request.group_id)
        if combined is None:
            pairs = raw + [(float(length), self.sibling_weight) for length in siblings]
            combined = self._combined[request.group_id] = _WeightedLengths(*zip(*pairs))
        return combined


@dataclass(frozen=True)
class LengthAccuracy:
    num_samples: int
    spearman: float  # rank correlation of predicted and true lengths
    mean_abs_error: float  # tokens
    mean_rel_error: float  # |predicted - true| / true


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1, ties sharing their average rank."""
    import numpy as np

    _, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
    cu_counts = np.cumsum(counts)
    average_rank = ((cu_counts - counts) + (cu_counts - 1)) / 2.0  # [num_unique]
    return average_rank[inverse.reshape(-1)]


def accuracy(predicted: Sequence[float], actual: Sequence[int]) -> LengthAccuracy:
    """Compare predictions with the true lengths of the same samples."""
    import numpy as np  # here: the scheduler process never needs numpy for this (~12 MB)

    pred = np.asarray(predicted, dtype=np.float64)  # [num_samples]
    true = np.asarray(actual, dtype=np.float64)  # [num_samples]
    if pred.shape != true.shape or pred.ndim != 1 or len(pred) == 0:
        raise ValueError(f"need two equal non-empty 1-D sequences, got {pred.shape} and {true.shape}")
    rank_pred, rank_true = _ranks(pred), _ranks(true)
    if rank_pred.std() == 0.0 or rank_true.std() == 0.0:
        spearman = 0.0
    else:
        spearman = float(np.corrcoef(rank_pred, rank_true)[0, 1])
    abs_err = np.abs(pred - true)
    return LengthAccuracy(len(pred), spearman, float(abs_err.mean()),
                          float((abs_err / np.maximum(true, 1.0)).mean()))
