"""The drafter's settings, in one frozen dataclass (the engine's hot path reads plain
attributes of it; nothing here changes while a drafter runs)."""

from __future__ import annotations

from dataclasses import dataclass

from services.rollout.engine.cost_model import CostModel


@dataclass(frozen=True)
class DrafterConfig:
    """How HistoDrafter indexes its three sources and how it scores and cuts drafts.

    Sources:
        use_history, use_siblings, use_prompt: feed the prompt's own index (earlier
            epochs, the live siblings, the prompt). Without siblings a request's own
            tokens are not indexed either (tracked only).
        use_global: also draft from the worker's global index of recent responses to
            all prompts (`add_global_responses`) and of the requests running here
            (indexed token by token).
        max_tokens_per_prompt: memory bound of one prompt's index, in indexed tokens.
        history_fraction: the share of it history may take at load (room for siblings).
        global_max_tokens: memory bound of the global index (two generations of half).
    Weights of evidence: history positions weigh `history_weight * recency_decay**age`
        (times exp(reward_temperature * z-scored reward) with `reward_weighting`), live
        sibling positions `sibling_weight`, prompt positions `prompt_weight`.
    Scoring (see walk.py):
        smoothing: pseudo-weight of "something unseen comes next" in each probability.
        backoff_weight: per different token seen after a context, the weight its
            estimate gives to the next shorter context's.
        match_len_prior, global_match_len_prior: a source matching the last L tokens is
            trusted L / (L + prior); the global index, shared by unrelated prompts,
            needs longer matches to be trusted as much.
        min_match_len: the shortest context a draft may start from (a match anchored at
            the start of the response is always long enough).
        min_gain: the lowest estimated chance that a whole draft prefix is accepted.
    Length:
        max_draft_len: the longest draft for one request.
        cost_model: the engine's cost curve; with it a draft token is kept only if its
            gain pays for one more token in the forward at the step's batch size.
    Trees (tree_walk.py, and its mirror in the compiled core, native/histo.cpp):
        tree: offer the engine draft trees (``propose_trees``) instead of linear drafts.
            Off by default until trees are shown to pay (docs/drafter.md).
        tree_width: the most children of a node (the candidates where sources disagree).
        tree_max_batch: trees only when a step drafts for at most this many sequences
            (the tail, where a forward over a few dozen tokens costs what one does);
            larger batches get the linear draft.
        tree_min_gain: min_gain for tree nodes (None: min_gain); the cost threshold
            still applies. A tree spends its verified tokens on several branches, so
            its floor sets how many it verifies: 0.15 verifies fewer tokens per step at
            the tail than vLLM's suffix method drafts (docs/drafter.md, "Draft trees").
    """

    use_history: bool = True
    use_siblings: bool = True
    use_prompt: bool = True
    use_global: bool = True
    max_tokens_per_prompt: int = 65536
    history_fraction: float = 0.75
    global_max_tokens: int = 262144
    history_weight: float = 1.0
    recency_decay: float = 0.7
    sibling_weight: float = 1.5
    prompt_weight: float = 0.5
    reward_weighting: bool = False
    reward_temperature: float = 1.0
    smoothing: float = 0.3
    backoff_weight: float = 2.0
    match_len_prior: float = 1.0
    global_match_len_prior: float = 1.0
    min_match_len: int = 1
    min_gain: float = 0.1
    max_draft_len: int = 16
    cost_model: CostModel | None = None
    tree: bool = False
    tree_width: int = 3
    tree_max_batch: int = 16
    tree_min_gain: float | None = 0.15

    def __post_init__(self) -> None:
        if self.max_tokens_per_prompt < 16 or self.global_max_tokens < 16:
            raise ValueError("max_tokens_per_prompt and global_max_tokens must be >= 16")
        if self.max_draft_len < 0 or self.min_match_len < 1:
            raise ValueError("max_draft_len must be >= 0 and min_match_len >= 1")
        if not 0.0 < self.history_fraction <= 1.0:
            raise ValueError("history_fraction must be in (0, 1]")
        if self.tree_width < 1 or self.tree_max_batch < 0:
            raise ValueError("tree_width must be >= 1 and tree_max_batch >= 0")
