"""What a returned logprob is, computed the one way the worker and a trainer both use.

``SamplingRows`` turns requests and positions into the sampler's per-row inputs: the
sampling parameters, the sample's seed and the token's absolute position, stop tokens
masked out of the distribution before ``min_tokens`` (vLLM's rule), and whether the
logprob is raw (over the whole vocabulary) or processed (over the tokens top-k / top-p /
min-p allow). The verifier builds its rows with it; so does ``reference_logprobs``.

``reference_logprobs`` is the trainer's reference: given a checkpoint (or a loaded
model), token sequences and the step's sampling parameters, it returns each response
token's logprob exactly as a rollout computed it. It runs this package's model code in
batch-invariant mode over each whole sequence (one prefill), the same attention
backend, the same ``SamplingRows`` and ``kernels.sampling.token_logprobs``, which
returns the sampler's own logprob bit for bit. Against workers in batch-invariant mode
(``RHYMERL_WORKER_BATCH_INVARIANT=1``, same device kind and dtype) the result equals the
rollout's logprobs bit for bit, with or without speculation, however the rollout was
batched, migrated or preempted; against other workers it equals them to rounding.
docs/sampling.md states the contract.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np
import torch

from kernels.sampling import token_logprobs
from services.rollout.engine.attention import AttentionMetadata, KVCache, PagedAttention
from services.rollout.engine.request import EngineRequest
from services.rollout.engine.sequence import Sequence

LOGPROBS_MODES = ("raw", "processed")


class SamplingRows:
    """The sampler's inputs for a batch of logits rows, added in order, a run of rows at a
    time: a request's consecutive positions (the verifier adds a sequence's last token and
    its draft in one call; this runs for every row of every step). The per-run values
    become per-row tensors with one ``np.repeat``."""

    def __init__(self):
        self.temperature: list[float] = []  # per run, like the five lists below
        self.top_k: list[int] = []
        self.top_p: list[float] = []
        self.min_p: list[float] = []
        self.seeds: list[int] = []
        self.processed: list[bool] = []
        self.first_positions: list[int] = []
        self.counts: list[int] = []  # rows in each run
        self.num_rows = 0
        self._run_of_row: np.ndarray | None = None  # the run each row belongs to, once made
        self.masked: list[tuple[int, list[int]]] = []  # (row, token ids out of its distribution)

    def add(self, req: EngineRequest, position: int, masked_token_ids: frozenset[int], count: int = 1) -> None:
        """``count`` rows: the tokens at absolute positions ``position``, ``position + 1``, ...
        of ``req``'s sample, each with ``masked_token_ids`` out of its distribution."""
        if masked_token_ids:
            ids = sorted(masked_token_ids)
            self.masked.extend((self.num_rows + j, ids) for j in range(count))
        self.temperature.append(req.temperature)
        self.top_k.append(max(req.top_k, 0))
        self.top_p.append(req.top_p)
        self.min_p.append(req.min_p)
        self.seeds.append(req.seed)
        self.processed.append(req.logprobs_mode == "processed")
        self.first_positions.append(position)
        self.counts.append(count)
        self.num_rows += count
        self._run_of_row = None

    def __len__(self) -> int:
        return self.num_rows

    def mask(self, logits: torch.Tensor) -> torch.Tensor:  # [num_rows, vocab]
        """The logits with each row's masked tokens at -inf (a copy if any is masked)."""
        if not self.masked:
            return logits
        logits = logits.clone()
        for row, ids in self.masked:
            logits[row, [i for i in ids if i < logits.shape[1]]] = float("-inf")
        return logits

    def _per_row(self, per_run: list, dtype: type) -> np.ndarray:
        values = np.array(per_run, dtype=dtype)
        if self.num_rows == len(self.counts):  # one row per run
            return values
        if self._run_of_row is None:
            self._run_of_row = np.repeat(np.arange(len(self.counts)), self.counts)
        return values[self._run_of_row]

    def _tensor(self, per_run: list, dtype: type, device) -> torch.Tensor:
        return torch.from_numpy(self._per_row(per_run, dtype)).to(device)

    def params(self, device) -> tuple[torch.Tensor, ...]:
        """(temperature, top_k, top_p, min_p) as the sampler takes them."""
        return (self._tensor(self.temperature, np.float32, device), self._tensor(self.top_k, np.int32, device),
                self._tensor(self.top_p, np.float32, device), self._tensor(self.min_p, np.float32, device))

    def keys(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(seeds, positions): what keys each row's noise."""
        positions = self._per_row(self.first_positions, np.int64)
        if self.num_rows != len(self.counts):  # each run's row j is at first_position + j
            run_starts = np.cumsum(self.counts) - self.counts
            positions = positions + np.arange(self.num_rows) - run_starts[self._run_of_row]
        return self._tensor(self.seeds, np.int64, device), torch.from_numpy(positions).to(device)

    def processed_rows(self, device) -> torch.Tensor:  # [num_rows] bool
        return self._tensor(self.processed, np.bool_, device)


@torch.inference_mode()
def reference_logprobs(model, sequences: Seq[tuple[Seq[int], Seq[int]]], sampling, *, device="cpu",
                       dtype: torch.dtype | None = None) -> list[list[float]]:
    """Each response token's logprob, as the rollout returned it.

    Args:
        model: a CausalLM, or the path of a checkpoint directory (config.json +
            safetensors) loaded on ``device`` in ``dtype`` (default: what a worker on
            that device uses, float32 on a CPU, the checkpoint's dtype on a GPU).
        sequences: (prompt token ids, response token ids) pairs, e.g. each
            ``Sample``'s prompt and ``token_ids``.
        sampling: the step's ``rhymerl.SamplingParams`` (temperature, top_k, top_p,
            min_p, min_tokens, stop_token_ids, ignore_eos, logprobs_mode); its seed
            does not matter.
    Returns:
        one list of float32 values per sequence, one per response token.
    """
    device = torch.device(device)
    if isinstance(model, (str, Path)):
        from services.rollout.loader import load_model, worker_dtype

        model = load_model(model, device, dtype or worker_dtype(device))
    model = model.to(device).eval()
    return [_sequence_logprobs(model, list(prompt), list(response), sampling, device)
            for prompt, response in sequences]


def sequence_logits(model, token_ids: list[int], device="cpu") -> torch.Tensor:
    """float32 logits [len(token_ids), vocab]: row i predicts the token after position i.

    One prefill of the whole sequence: in batch-invariant mode every position's logits
    are those the rollout's decode, verify or re-prefill computed there.
    """
    device = torch.device(device)
    cfg = model.config
    num_tokens, block_size = len(token_ids), 16
    num_blocks = -(-num_tokens // block_size)
    attn = PagedAttention(KVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                                  cfg.head_dim, next(model.parameters()).dtype, device),
                          cfg.head_dim ** -0.5, batch_invariant=True)
    attn.metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :],
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device), max_query_len=num_tokens)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)
    hidden = model.forward(ids, torch.arange(num_tokens, device=device), attn)  # [num_tokens, hidden]
    return model.compute_logits(hidden, batch_invariant=True).float()


def _sequence_logprobs(model, prompt: list[int], response: list[int], sampling, device) -> list[float]:
    if not response:
        return []
    cfg = model.config
    req = EngineRequest(
        request_id="reference", prompt_id="reference", step_id="", sample_index=0, prompt_token_ids=prompt,
        generated_token_ids=response, temperature=sampling.temperature, top_p=sampling.top_p or 1.0,
        top_k=sampling.top_k, min_p=sampling.min_p, seed=0, max_tokens=len(response) + 1, max_new_tokens=1,
        stop_token_ids=frozenset(sampling.stop_token_ids), min_tokens=sampling.min_tokens,
        ignore_eos=sampling.ignore_eos, logprobs=True, logprobs_mode=sampling.logprobs_mode)
    seq = Sequence(req, cfg.eos_token_ids, cfg.max_position_embeddings)
    first = len(prompt)
    logits = sequence_logits(model, seq.token_ids, device)[first - 1:-1]  # [len(response), vocab]
    rows = SamplingRows()
    for j in range(len(response)):
        rows.add(req, first + j, seq.masked_token_ids(j))
    tokens = torch.tensor(response, dtype=torch.int64, device=device)
    return token_logprobs(rows.mask(logits), tokens, *rows.params(device), rows.processed_rows(device)).tolist()
