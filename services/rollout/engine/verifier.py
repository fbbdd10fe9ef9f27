"""Speculative verification: from logits to the tokens each sequence commits this step.

A sequence that samples this step fed its last token plus a draft d_1..d_k, so its
logits rows 0..k predict the tokens at positions L..L+k (L = its length). We sample the
policy's own token s_j at every row with ``kernels.sampling.sample``, keyed on (seed,
absolute position): exactly the token a run without speculation would draw there. The
draft is accepted for the longest prefix with d_{j+1} == s_j; the committed tokens are
s_0..s_a (a accepted drafts, then one recovered token if a draft was rejected, or the
bonus token if all were accepted). Every token is therefore drawn from the policy's own
distribution at its position, with and without speculation, greedy or sampled: lossless
by construction, and reproducible from the seed. Token for token and logprob for logprob
the same output needs the verify rows' logits to equal the decode rows' bit for bit,
which batch-invariant mode guarantees (docs/sampling.md).

Before min_tokens, stop tokens are masked out of the distribution (vLLM's rule), also
on draft rows, so the same positions see the same distribution either way. The rows'
inputs come from ``SamplingRows`` (logprobs.py), which the trainer's reference shares.

This module knows nothing about KV blocks or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampling import sample
from services.rollout.engine.logprobs import SamplingRows
from services.rollout.engine.sequence import Sequence


_NOTHING: frozenset[int] = frozenset()


@dataclass(slots=True)
class Verdict:
    token_ids: list[int]  # s_0..s_a: the accepted drafts then the recovered/bonus token
    logprobs: list[float]  # the policy's logprob of each
    num_draft: int
    num_accepted: int


def num_accepted(draft: list[int], sampled: list[int]) -> int:
    """Length of the longest draft prefix that equals the policy's samples."""
    a = 0
    while a < len(draft) and draft[a] == sampled[a]:
        a += 1
    return a


def verify(logits: torch.Tensor, seqs: list[Sequence]) -> list[Verdict]:
    """Sample every row and accept each sequence's draft.

    Args:
        logits: [sum(1 + len(seq.draft_token_ids)), vocab] float32, rows in seqs order.
        seqs: the sequences that sample this step, in batch order.
    Returns:
        one Verdict per sequence.
    """
    if not seqs:
        return []
    rows = SamplingRows()
    for seq in seqs:
        # the token sampled at row j sits at absolute position num_tokens + j; stop tokens
        # are masked on the rows before min_tokens (Sequence.masked_token_ids)
        num_tokens, num_rows = len(seq.token_ids), 1 + len(seq.draft_token_ids)
        num_masked = min(num_rows, seq.req.min_tokens - (num_tokens - seq.num_prompt_tokens))
        if num_masked > 0 and seq.stop_token_ids:
            rows.add(seq.req, num_tokens, seq.stop_token_ids, num_masked)
            if num_masked < num_rows:
                rows.add(seq.req, num_tokens + num_masked, _NOTHING, num_rows - num_masked)
        else:
            rows.add(seq.req, num_tokens, _NOTHING, num_rows)
    assert len(rows) == logits.shape[0], (len(rows), logits.shape)
    dev = logits.device
    tokens, logprobs = sample(rows.mask(logits), *rows.params(dev), *rows.keys(dev), rows.processed_rows(dev))
    tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
    verdicts, row = [], 0
    for seq in seqs:
        draft = seq.draft_token_ids
        if not draft:  # a plain decode: its one sampled token
            verdicts.append(Verdict([tokens_l[row]], [logprobs_l[row]], 0, 0))
            row += 1
            continue
        sampled = tokens_l[row:row + 1 + len(draft)]
        a = num_accepted(draft, sampled)
        verdicts.append(Verdict(sampled[:a + 1], logprobs_l[row:row + a + 1], len(draft), a))
        row += 1 + len(draft)
    return verdicts
