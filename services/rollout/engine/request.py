"""What the worker server hands the engine, and what it gets back: one chunk of one sample.

A request is one (prompt, sample index) of a training step, asked to generate at most
``max_new_tokens`` more tokens (a chunk: divided rollout, docs/architecture.md). A later chunk
of the same sample arrives as a new request whose ``generated_token_ids`` holds the
earlier chunks' tokens; because sampling is keyed on (seed, position), the resumed sample
continues as an uninterrupted one would (bit for bit in batch-invariant mode, docs/sampling.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineRequest:
    request_id: str
    prompt_id: str
    step_id: str
    sample_index: int
    prompt_token_ids: list[int]
    generated_token_ids: list[int]  # resume: tokens from earlier chunks
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    max_tokens: int  # the sample's overall max
    max_new_tokens: int  # this chunk's budget
    stop_token_ids: frozenset[int]
    min_tokens: int
    ignore_eos: bool
    logprobs: bool
    logprobs_mode: str = "raw"  # "raw" | "processed" (services/rollout/engine/logprobs.py)


@dataclass
class RequestOutput:
    """One chunk's result, returned once per request when its chunk ends."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None  # 'stop' | 'length' | 'abort' | None (chunk budget reached, more to go)
    num_verify_steps: int = 0  # steps that carried a draft for this request
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i] = drafts whose position i was accepted
    busy_s: float = 0.0  # wall time of the engine steps this request took part in
