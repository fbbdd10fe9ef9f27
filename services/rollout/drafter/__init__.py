"""Model-free drafters for speculative decoding in RL rollouts.

- `HistoDrafter` (drafter.py): the engine-facing lifecycle; drafts from earlier epochs'
  responses, live siblings, the prompt and the worker's recent responses to all prompts.
  The Python reference of:
- `CompiledDrafter` (compiled.py): the same drafts from the C++ core in native/ (histo.cpp,
  a flat C ABI loaded with ctypes, built by `make install`), batched: the worker's default
  (RHYMERL_WORKER_DRAFTER=compiled).
- `DrafterConfig` (config.py): its settings, one frozen dataclass.
- walk.py: one draft from several indexes scored together (pure functions).
- tree_walk.py: one draft tree, branching where the sources disagree (`propose_trees`,
  with `DrafterConfig.tree`; the compiled core mirrors it).
- budget.py: draft length from the engine's cost curve.
- `PromptIndex` (prompt_index.py): one prompt's sources under a token budget.
- `GlobalIndex` (global_index.py): recent responses to all prompts, bounded.
- `SuffixIndex` (suffix_index.py): the weighted generalized suffix automaton.
- ngram.py: vLLM's n-gram prompt lookup, the baseline.
"""

from services.rollout.drafter.budget import (
    draft_within_budget,
    gain_threshold,
    trim_to_budget,
)
from services.rollout.drafter.config import DrafterConfig
from services.rollout.drafter.drafter import (
    DrafterStats,
    HistoDrafter,
    UnknownRequestError,
)
from services.rollout.drafter.global_index import GlobalIndex
from services.rollout.drafter.ngram import NgramContext, propose_ngram
from services.rollout.drafter.suffix_index import SuffixIndex

__all__ = [
    "DrafterConfig",
    "DrafterStats",
    "GlobalIndex",
    "HistoDrafter",
    "NgramContext",
    "SuffixIndex",
    "UnknownRequestError",
    "draft_within_budget",
    "gain_threshold",
    "propose_ngram",
    "trim_to_budget",
]
