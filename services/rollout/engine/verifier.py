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
on draft rows, so the same positions see the same distribution either way. The rows
come from the step's ``StepSampling`` (step_inputs.py): each row's request slot, whose
sampling parameters stay on the device (input_batch.SlotParams), and its position; the
trainer's reference builds the same per-row values with ``SamplingRows`` (logprobs.py).

A tree draft (``seq.draft_parents``, engine/tree.py) is verified the same way: row r at
depth d samples the token at L + d, and the walk from the root follows the child equal to
the sampled token (``tree.accept_path``); a chain gives the linear verdict exactly.

The sampled tokens and logprobs come back to the host in one read (the step's only wait
for the device); the acceptance walk runs on the host lists. A step laid out by
step_inputs' decode path (every sequence its last token and perhaps a linear draft: the
common verify step) is accepted by array operations over the whole batch instead
(``verify_linear``): row r's draft token is the token fed at row r + 1 of its sequence.

This module knows nothing about KV blocks or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.sampling import sample
from services.rollout.engine.input_batch import HostReader, PendingRead, SlotParams, StepSampling
from services.rollout.engine.sequence import Sequence
from services.rollout.engine.step_inputs import sampling_of
from services.rollout.engine.tree import accept_path


@dataclass(slots=True)
class Verdict:
    token_ids: list[int]  # s_0..s_a: the accepted drafts then the recovered/bonus token
    logprobs: list[float]  # the policy's logprob of each
    num_draft: int  # draft tokens verified (a tree's nodes)
    num_accepted: int
    path: list[int] | None = None  # a tree's accepted nodes, root to leaf (None: a linear draft)


def num_accepted(draft: list[int], sampled: list[int]) -> int:
    """Length of the longest draft prefix that equals the policy's samples."""
    a = 0
    while a < len(draft) and draft[a] == sampled[a]:
        a += 1
    return a


def sample_rows(logits: torch.Tensor, sampling: StepSampling, params: SlotParams,
                reader: HostReader | None = None) -> tuple[list[int], list[float]]:
    """The policy's token and its logprob at every row of ``logits`` (the step's rows in
    ``sampling``, their parameters in ``params``), read back to the host at once."""
    tokens, logprobs = sample_arrays(logits, sampling, params, reader)
    return tokens.tolist(), logprobs.tolist()


def sample_arrays(logits: torch.Tensor, sampling: StepSampling, params: SlotParams,
                  reader: HostReader | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``sample_rows`` as numpy arrays: int64 tokens and float32 logprobs, one per row,
    read at once (valid until the reader's second next read: ``PendingRead.result``)."""
    return (reader or HostReader()).read_pair_later(*_sample(logits, sampling, params)).result()


def sample_later(logits: torch.Tensor, sampling: StepSampling, params: SlotParams,
                 reader: HostReader) -> tuple[torch.Tensor, PendingRead]:
    """``sample_arrays`` without waiting for the device: the sampled tokens where they
    are ([num_rows] int64, what a next step can feed without reading them) and their read
    to the host with their logprobs, queued (``PendingRead.result``: the int64 tokens and
    float32 logprobs as numpy arrays)."""
    tokens, logprobs = _sample(logits, sampling, params)
    return tokens, reader.read_pair_later(tokens, logprobs)


def _sample(logits: torch.Tensor, sampling: StepSampling, params: SlotParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampler over the step's rows, on the device: tokens and their logprobs."""
    assert len(sampling.row_slots_host) == len(logits), (sampling.row_slots_host.shape, logits.shape)
    temperature, top_k, top_p, min_p, seeds, processed, truncation = params.rows(sampling)
    if sampling.masked is not None:
        logits = logits.clone()
        logits.view(-1).index_fill_(0, sampling.masked, float("-inf"))
    return sample(logits, temperature, top_k, top_p, min_p, seeds, sampling.positions, processed,
                  truncation=truncation)


@dataclass(slots=True)
class LinearVerdicts:
    """A decode-layout step's verdicts (``verify_linear``), as arrays over its sequences:
    sequence i's rows are ``query_start[i]:query_start[i + 1]``, it committed the tokens
    (and logprobs) sampled at its first ``num_accepted[i] + 1`` rows."""

    token_ids: list[int]  # every row's sampled token
    logprobs: list[float]
    query_start: np.ndarray  # [num_seqs + 1]
    num_draft: np.ndarray  # [num_seqs] draft tokens verified
    num_accepted: np.ndarray  # [num_seqs]
    tokens: np.ndarray  # [num_rows] token_ids as an array
    rows_per_seq: int = 0  # every sequence's number of rows where it is the same (0: not known)

    def committed(self, first: int, end: int) -> np.ndarray:
        """The tokens sequences ``first..end - 1`` commit (each its first num_accepted + 1
        rows), in order, as one array."""
        q = self.rows_per_seq
        if q:  # the rows as a [sequences, rows] grid
            return self.tokens.reshape(-1, q)[first:end][np.arange(q) <= self.num_accepted[first:end, None]]
        qs = self.query_start
        lo, hi = int(qs[first]), int(qs[end])
        lens = qs[first + 1:end + 1] - qs[first:end]
        offset = np.arange(hi - lo) - np.repeat(qs[first:end] - lo, lens)
        return self.tokens[lo:hi][offset <= np.repeat(self.num_accepted[first:end], lens)]


def accepted_lengths(sampled: np.ndarray, fed: np.ndarray, query_start: np.ndarray,
                     rows_per_seq: int = 0) -> np.ndarray:
    """Per sequence, the longest draft prefix equal to the policy's samples, for every
    sequence at once: sequence i fed its last token then its draft at rows
    ``query_start[i]:query_start[i + 1]`` (``fed``), and row r's sample is compared with
    the token fed at row r + 1. The first row that does not match (every sequence's last
    row never does) ends each sequence's accepted run. ``rows_per_seq``: every sequence's
    number of rows where they are all the same (0: not known), which takes a shorter
    route: the rows as a [sequences, rows] grid, each sequence's run of matches from its
    first."""
    if rows_per_seq:
        q = rows_per_seq
        grid_fed, grid_sampled = fed.reshape(-1, q), sampled.reshape(-1, q)
        return np.logical_and.accumulate(grid_fed[:, 1:] == grid_sampled[:, :-1], axis=1).sum(axis=1)
    matches = np.zeros(len(sampled), dtype=np.bool_)
    matches[:-1] = fed[1:] == sampled[:-1]
    matches[query_start[1:] - 1] = False
    stops = np.flatnonzero(~matches)
    starts = query_start[:-1]
    return stops[np.searchsorted(stops, starts)] - starts


def verify_linear(logits: torch.Tensor, sampling: StepSampling, params: SlotParams,
                  reader: HostReader | None = None) -> LinearVerdicts:
    """``verify`` for a step of ``prepare_step``'s decode layout (``sampling.fed_host`` set):
    every row sampled and every sequence's draft accepted by array operations."""
    tokens, logprobs = sample_arrays(logits, sampling, params, reader)
    query_start = sampling.query_start_host
    num_accepted = accepted_lengths(tokens, sampling.fed_host, query_start, sampling.rows_per_seq)
    return LinearVerdicts(tokens.tolist(), logprobs.tolist(), query_start, np.diff(query_start) - 1, num_accepted,
                          tokens, sampling.rows_per_seq)


def verify(logits: torch.Tensor, seqs: list[Sequence], sampling: StepSampling | None = None,
           params: SlotParams | None = None, reader: HostReader | None = None) -> list[Verdict]:
    """Sample every row and accept each sequence's draft.

    Args:
        logits: [sum(1 + len(seq.draft_token_ids)), vocab] float32, rows in seqs order.
        seqs: the sequences that sample this step, in batch order.
        sampling, params: the step's rows and the slots their parameters sit in (the
            engine's, from ``prepare_step``); None: made here from ``seqs``.
        reader: reads the sampled tokens back (None: a fresh one).
    Returns:
        one Verdict per sequence.
    """
    if not seqs:
        return []
    if sampling is None:
        params = SlotParams(logits.shape[1], logits.device, capacity=len(seqs))
        sampling = sampling_of(seqs, params, logits.device)
    tokens_l, logprobs_l = sample_rows(logits, sampling, params, reader)
    if len(tokens_l) == len(seqs):  # no drafts: each sequence's one sampled token
        return [Verdict([t], [lp], 0, 0) for t, lp in zip(tokens_l, logprobs_l)]
    verdicts, row = [], 0
    for seq in seqs:
        draft = seq.draft_token_ids
        if not draft:  # a plain decode: its one sampled token
            verdicts.append(Verdict([tokens_l[row]], [logprobs_l[row]], 0, 0))
            row += 1
            continue
        sampled = tokens_l[row:row + 1 + len(draft)]
        if seq.draft_parents is None:
            a = num_accepted(draft, sampled)
            verdicts.append(Verdict(sampled[:a + 1], logprobs_l[row:row + a + 1], len(draft), a))
        else:
            verdicts.append(tree_verdict(draft, seq.draft_parents, sampled, logprobs_l[row:row + 1 + len(draft)]))
        row += 1 + len(draft)
    return verdicts


def tree_verdict(tokens: list[int], parents: list[int], sampled: list[int], logprobs: list[float]) -> Verdict:
    """A tree's verdict from the token and logprob sampled at each of its rows (row 0 the
    root, row i + 1 node i): the accepted path's tokens, then the token sampled at its
    last node (the recovered or bonus token)."""
    path = accept_path(tokens, parents, sampled)
    rows = [0] + [i + 1 for i in path]
    return Verdict([sampled[r] for r in rows], [logprobs[r] for r in rows], len(tokens), len(path), path)
