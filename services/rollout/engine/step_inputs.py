"""The flat layout of one step's tokens, built on the host once per step.

Each sequence feeds its ``num_scheduled_tokens`` tokens from ``num_computed_tokens`` on,
then, if that reaches its end (it samples), its draft. The step concatenates them:
  input_ids, positions, slot_mapping  one entry per fed token (slot = the KV cache row:
                                      block_table[p // block_size] * block_size + p % block_size);
  sample_rows                         the rows whose logits are needed: the last fed token
                                      of each sampling sequence, then one per draft token;
  block_tables, seq_lens, query_start_loc  one row / entry per sequence.

This runs on the host before every forward, so it is written for the common decode
step of a large batch: per sequence a few list operations (slot mappings are ranges per
block, not one computation per token), and every integer goes to the device in two
copies (one int64 buffer, one int32 buffer) whose slices are the tensors, instead of one
copy each, made through numpy (a list of ints to a tensor costs ~3x less that way than
with ``torch.tensor``). Slices start at multiples of 4 entries, so every tensor is 16-byte aligned
like a fresh allocation (Triton specialises kernels on pointer alignment).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.rollout.engine.attention import AttentionMetadata
from services.rollout.engine.sequence import Sequence

_ALIGN = 4  # entries: 16 bytes of int32, 32 of int64


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sample_rows] int64, rows of the flat batch whose logits are needed
    num_seqs: int
    num_tokens: int
    is_prefill: bool  # any sequence fed more than its last token


def prepare_step(seqs: list[Sequence], block_size: int, device: torch.device) -> StepInputs:
    bs = block_size
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    seq_lens: list[int] = []
    cu_q = [0]
    width = max(len(s.block_table) for s in seqs)
    zeros = [0] * width
    tables: list[int] = []
    num_tokens, max_query_len = 0, 1  # every scheduled sequence feeds a token at least
    is_prefill = False
    for seq in seqs:
        start, n, table, token_ids = seq.num_computed_tokens, seq.num_scheduled_tokens, seq.block_table, seq.token_ids
        if n == 1 and start + 1 == len(token_ids) and not seq.draft_token_ids:  # a plain decode
            input_ids.append(token_ids[start])
            positions.append(start)
            slots.append(table[start // bs] * bs + start % bs)
            sample_rows.append(num_tokens)
            num_tokens += 1
        else:
            end = start + n
            input_ids.extend(token_ids[start:end])
            if end == len(token_ids):  # samples: its draft follows; rows: its last fed token's, the draft's
                input_ids.extend(seq.draft_token_ids)
                end += len(seq.draft_token_ids)
                sample_rows.extend(range(num_tokens + n - 1, num_tokens + end - start))
            for b in range(start // bs, (end - 1) // bs + 1):  # the block's run of positions
                first = b * bs
                base = table[b] * bs - first
                slots.extend(range(base + max(start, first), base + min(end, first + bs)))
            positions.extend(range(start, end))
            num_tokens += end - start
            max_query_len = max(max_query_len, end - start)
            is_prefill |= n > 1
        cu_q.append(num_tokens)
        seq_lens.append(positions[-1] + 1)
        tables.extend(table)
        tables.extend(zeros[len(table):])
    ids_t, pos_t, slots_t, rows_t = _packed([input_ids, positions, slots, sample_rows], np.int64, device)
    tables_t, lens_t, cu_t = _packed([tables, seq_lens, cu_q], np.int32, device)
    md = AttentionMetadata(slot_mapping=slots_t, block_tables=tables_t.view(len(seqs), width), seq_lens=lens_t,
                           query_start_loc=cu_t, max_query_len=max_query_len)
    return StepInputs(input_ids=ids_t, positions=pos_t, metadata=md, sample_rows=rows_t, num_seqs=len(seqs),
                      num_tokens=num_tokens, is_prefill=is_prefill)


def host_tensor(values: list, dtype: type, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, device=device)`` with ``dtype`` a numpy dtype, through numpy:
    the same values (and float rounding), in a third of the host time."""
    return torch.from_numpy(np.array(values, dtype=dtype)).to(device)


def _packed(parts: list[list[int]], dtype: type, device: torch.device) -> list[torch.Tensor]:
    """``parts`` as tensors on ``device``: slices of one buffer that holds them end to end
    (each from an aligned offset), so one host->device copy."""
    flat: list[int] = []
    bounds = []
    for part in parts:
        flat.extend([0] * (-len(flat) % _ALIGN))
        bounds.append((len(flat), len(flat) + len(part)))
        flat.extend(part)
    buf = host_tensor(flat, dtype, device)
    return [buf[a:b] for a, b in bounds]
