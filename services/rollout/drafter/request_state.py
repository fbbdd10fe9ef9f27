"""Per-request state of HistoDrafter, and the counters it reports."""

from __future__ import annotations

from dataclasses import dataclass

from services.rollout.drafter.config import DrafterConfig
from services.rollout.drafter.global_index import GlobalIndex, GlobalMatch
from services.rollout.drafter.prompt_index import LiveSequence
from services.rollout.drafter.suffix_index import SuffixIndex
from services.rollout.drafter.walk import Source, prepare

_DECAY = 0.8  # per step, of a request's acceptance evidence


@dataclass(frozen=True)
class DrafterStats:
    """Cumulative counters for the engine's metrics (vLLM's spec-decode naming), so a
    drafter that stops drafting is seen, never silent."""

    num_requests_asked: int  # (request, step) pairs propose was asked to draft for
    num_empty_drafts: int  # ... of which got no draft (no context, cut by gain/budget)
    num_draft_tokens: int
    num_accepted_tokens: int
    num_prompts: int  # prompts indexed now
    memory_tokens: int  # tokens indexed now, over all prompts
    global_tokens: int  # tokens in the global index now



class RequestState:
    """What the drafter keeps per running request: its sequence, its global matches and
    the evidence that calibrates its gains."""

    __slots__ = ("calibration_used", "glob", "last_gains", "obs", "pred", "prompt_id", "seq")

    def __init__(self, prompt_id: str, seq: LiveSequence, glob: GlobalMatch | None) -> None:
        self.prompt_id = prompt_id
        self.seq = seq
        self.glob = glob  # its matches in the global index (None: not used)
        self.obs = 0.0  # decayed count of draft tokens accepted
        self.pred = 0.0  # decayed sum of their modelled acceptance probabilities
        self.last_gains: list[float] = []
        self.calibration_used = 1.0

    def decay(self) -> None:
        """One step passed: older evidence counts less."""
        self.obs *= _DECAY
        self.pred *= _DECAY

    @property
    def calibration(self) -> float:
        # One pseudo-token of prior: with no recent evidence the gains are taken as is.
        # Both sums decay every step, so a request that stopped drafting recovers.
        return min(1.5, max(0.25, (self.obs + 1.0) / (self.pred + 1.0)))

    def sources(self, prompt_index: SuffixIndex, global_index: GlobalIndex | None,
                cfg: DrafterConfig) -> list[Source]:
        """Where its continuation is matched now: its prompt's index, then each generation
        of the global index (whose matches catch up first if the generations changed)."""
        seq = self.seq
        num_tokens = len(seq.tokens)
        sources = []
        source = prepare(prompt_index, seq.state, seq.match_len, cfg.match_len_prior, cfg.min_match_len, num_tokens)
        if source is not None:
            sources.append(source)
        glob = self.glob
        if glob is not None:
            if glob.flips != global_index.flips:  # generations changed since its last tokens
                global_index.follow(glob, seq.tokens, 0)
            for index, state, length in zip(global_index.generations, glob.states, glob.lens):
                source = prepare(index, state, length, cfg.global_match_len_prior, cfg.min_match_len, num_tokens)
                if source is not None:
                    sources.append(source)
        return sources
