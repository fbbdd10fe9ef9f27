"""The seam between a decoder and whoever owns its attention state.

A model only projects q/k/v and applies RoPE; an AttentionBackend decides which keys each
query sees. The engine's paged backend (KV cache, block tables, CUDA graphs) lives
elsewhere; this module has the cache-free dense backend that training, tests and
references use, and knows nothing about caches or scheduling.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor


class AttentionBackend(Protocol):
    """Attention over one step's flat batch of tokens.

    Called by the model once per layer per forward, in layer order. The backend owns the
    KV cache (if any) and the step's metadata (which sequence each token belongs to,
    where its keys live), set up by its owner before the forward.
    """

    # True: the model runs batch-invariant kernels (services/rollout/models/transformer.py)
    # and the backend's attention gives each query row a result independent of the batch.
    batch_invariant: bool

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """
        Args:
            layer_idx: index of the decoder layer calling.
            q: [num_tokens, num_heads, head_dim], RoPE already applied.
            k: [num_tokens, num_kv_heads, head_dim], RoPE already applied.
            v: [num_tokens, num_kv_heads, head_dim]

        Returns:
            [num_tokens, num_heads, head_dim]
        """
        ...


def packed_positions(cu_seqlens: Tensor) -> Tensor:
    """Positions 0..len-1 restarting at each sequence of a packed batch.

    Args:
        cu_seqlens: [num_seqs + 1] int, cumulative sequence lengths starting at 0.

    Returns:
        [num_tokens] int64
    """
    cu_seqlens = cu_seqlens.long()
    seq_lens = cu_seqlens.diff()  # [num_seqs]
    num_tokens = int(cu_seqlens[-1])
    starts = torch.repeat_interleave(cu_seqlens[:-1], seq_lens, output_size=num_tokens)  # [num_tokens]
    return torch.arange(num_tokens, device=cu_seqlens.device) - starts


class DenseCausalAttention:
    """Block-diagonal causal attention over whole sequences packed flat, without a cache.

    Every token of a sequence is in the batch, so token i of a sequence sees tokens 0..i
    of the same sequence. Sequences are padded to the longest one so that SDPA runs once
    per layer; the padding metadata is built once here and reused by every layer.
    Differentiable (used for training).
    """

    batch_invariant = False

    def __init__(self, cu_seqlens: Tensor):
        """
        Args:
            cu_seqlens: [num_seqs + 1] int, cumulative sequence lengths starting at 0.
        """
        cu_seqlens = cu_seqlens.long()
        device = cu_seqlens.device
        seq_lens = cu_seqlens.diff()  # [num_seqs]
        self.num_seqs = seq_lens.numel()
        self.num_tokens = int(cu_seqlens[-1])
        self.max_seqlen = int(seq_lens.max()) if self.num_seqs else 0
        offsets = packed_positions(cu_seqlens)  # [num_tokens]
        seq_ids = torch.repeat_interleave(torch.arange(self.num_seqs, device=device), seq_lens)
        # Slot of each token in the padded [num_seqs, max_seqlen] layout.
        self.padded_slots = seq_ids * self.max_seqlen + offsets  # [num_tokens]
        # Token filling each padded slot; padding slots borrow their sequence's first token,
        # whose output is thrown away (and whose gradient is therefore zero).
        slot_offsets = torch.arange(self.max_seqlen, device=device)  # [max_seqlen]
        valid = slot_offsets[None, :] < seq_lens[:, None]  # [num_seqs, max_seqlen]
        slot_tokens = cu_seqlens[:-1, None] + slot_offsets[None, :]  # [num_seqs, max_seqlen]
        self.slot_tokens = torch.where(valid, slot_tokens, cu_seqlens[:-1, None]).flatten()
        # Padding keys are hidden from every query. Padding queries still see their
        # sequence's real keys, which keeps every softmax row finite (a fully masked row
        # would be NaN, and NaN times a zero gradient is still NaN).
        causal = slot_offsets[None, :] <= slot_offsets[:, None]  # [max_seqlen, max_seqlen]
        self.mask = (causal[None, :, :] & valid[:, None, :])[:, None]  # [num_seqs, 1, max_seqlen, max_seqlen]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        if q.shape[0] != self.num_tokens:
            raise ValueError(f"q has {q.shape[0]} tokens, cu_seqlens describes {self.num_tokens}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"{num_kv_heads} kv heads do not divide {num_heads} query heads")
        q_pad = self._pad(q)  # [num_seqs, num_heads, max_seqlen, head_dim]
        k_pad = self._pad(k).repeat_interleave(num_heads // num_kv_heads, dim=1)
        v_pad = self._pad(v).repeat_interleave(num_heads // num_kv_heads, dim=1)
        if self.num_seqs == 1:
            out = F.scaled_dot_product_attention(q_pad, k_pad, v_pad, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q_pad, k_pad, v_pad, attn_mask=self.mask)
        out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [num_seqs * max_seqlen, num_heads, head_dim]
        return out[self.padded_slots]

    def _pad(self, x: Tensor) -> Tensor:
        """[num_tokens, heads, head_dim] -> [num_seqs, heads, max_seqlen, head_dim]"""
        return x[self.slot_tokens].view(self.num_seqs, self.max_seqlen, x.shape[1], x.shape[2]).transpose(1, 2)
