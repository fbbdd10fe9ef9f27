"""Model-free drafters for speculative decoding in RL rollouts.

- `HistoDrafter` (drafter.py): the engine-facing lifecycle API; drafts from earlier
  epochs' responses, live siblings and the prompt.
- `PromptIndex` (prompt_index.py): one prompt's sources under a token budget.
- `SuffixIndex` (suffix_index.py): the weighted generalized suffix automaton.
- budget.py: draft budgets from the engine's cost curve.
- ngram.py: vLLM's n-gram prompt lookup, the baseline.
"""

from services.rollout.drafter.budget import (
    QWEN2_5_0_5B_H100,
    CostCurve,
    all_drafts_pay,
    budget_from_gains,
    expected_tokens_per_step,
    uniform_draft_budget,
)
from services.rollout.drafter.drafter import (
    DrafterStats,
    HistoDrafter,
    UnknownRequestError,
)
from services.rollout.drafter.ngram import NgramContext, propose_ngram
from services.rollout.drafter.suffix_index import SuffixIndex

__all__ = [
    "QWEN2_5_0_5B_H100",
    "CostCurve",
    "DrafterStats",
    "HistoDrafter",
    "NgramContext",
    "SuffixIndex",
    "UnknownRequestError",
    "all_drafts_pay",
    "budget_from_gains",
    "expected_tokens_per_step",
    "propose_ngram",
    "uniform_draft_budget",
]
