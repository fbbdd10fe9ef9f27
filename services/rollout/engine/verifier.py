"""Speculative verification: from logits to the tokens each sequence commits this step.

A sequence that samples this step fed its last token plus a draft d_1..d_k, so its
logits rows 0..k predict the tokens at positions L..L+k (L = its length). We sample the
policy's own token s_j at every row with ``kernels.sampling.sample``, keyed on (seed,
absolute position): exactly the token a run without speculation would draw there. The
draft is accepted for the longest prefix with d_{j+1} == s_j; the committed tokens are
s_0..s_a (a accepted drafts, then one recovered token if a draft was rejected, or the
bonus token if all were accepted). The output is therefore identical, token for token
and logprob for logprob, with and without speculation, for greedy and sampled decoding
alike: lossless by construction, and reproducible from the seed.

Before min_tokens, stop tokens are masked out of the distribution (vLLM's rule), also
on draft rows, so the same positions see the same distribution either way.

This module knows nothing about KV blocks or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.sampling import sample
from services.rollout.engine.sequence import Sequence


@dataclass
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
    temperature, top_k, top_p, min_p, seeds, positions = [], [], [], [], [], []
    masked_rows: list[tuple[int, list[int]]] = []
    row = 0
    for seq in seqs:
        req = seq.req
        for j in range(1 + len(seq.draft_token_ids)):
            temperature.append(req.temperature)
            top_k.append(max(req.top_k, 0))
            top_p.append(req.top_p)
            min_p.append(req.min_p)
            seeds.append(req.seed)
            positions.append(seq.num_tokens + j)  # absolute position of the token sampled here
            masked = seq.masked_token_ids(seq.num_generated + j)
            if masked:
                masked_rows.append((row, sorted(masked)))
            row += 1
    assert row == logits.shape[0], (row, logits.shape)
    if masked_rows:
        logits = logits.clone()
        for r, ids in masked_rows:
            logits[r, [i for i in ids if i < logits.shape[1]]] = float("-inf")
    dev = logits.device
    tokens, logprobs = sample(
        logits,
        torch.tensor(temperature, dtype=torch.float32, device=dev),
        torch.tensor(top_k, dtype=torch.int32, device=dev),
        torch.tensor(top_p, dtype=torch.float32, device=dev),
        torch.tensor(min_p, dtype=torch.float32, device=dev),
        torch.tensor(seeds, dtype=torch.int64, device=dev),
        torch.tensor(positions, dtype=torch.int64, device=dev))
    tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
    verdicts, row = [], 0
    for seq in seqs:
        draft = seq.draft_token_ids
        sampled = tokens_l[row:row + 1 + len(draft)]
        a = num_accepted(draft, sampled)
        verdicts.append(Verdict(sampled[:a + 1], logprobs_l[row:row + a + 1], len(draft), a))
        row += 1 + len(draft)
    return verdicts
