"""The paged AttentionBackend the model calls in every layer: KV write + paged attention.

The model (services/rollout/models) sees only ``attn(layer_idx, q, k, v)``; this
backend holds the KV cache of every layer and the current step's metadata (where each
new token's KV goes, each sequence's block table, context and query lengths), set by
the model runner before the forward. Decode, ragged verify and chunked prefill are the
same call, and so is a draft tree's verify (the metadata's ``tree_mask``). It knows
nothing about sequences or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_attention import paged_attention, write_kv
from kernels.rotary import rope_store


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token's KV, < 0 = padding
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including the new tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cu offsets of each sequence's new tokens
    max_query_len: int
    # [num_tokens] int64, per new token the rows of its sequence's query it sees (a draft
    # tree's ancestors, engine/tree.py; -1: all earlier rows); None: causal everywhere
    tree_mask: torch.Tensor | None = None


class KVCache:
    """Per-layer K and V block pools: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PagedAttention:
    """AttentionBackend over a KVCache; ``metadata`` must be set before each forward."""

    def __init__(self, kv_cache: KVCache, scale: float, batch_invariant: bool = False):
        self.kv_cache = kv_cache
        self.scale = scale
        self.batch_invariant = batch_invariant
        self.metadata: AttentionMetadata | None = None

    def __call__(
        self,
        layer_idx: int,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim], RoPE applied
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], RoPE applied
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        md = self.metadata
        k_cache, v_cache = self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx]
        write_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, md.slot_mapping)
        return self._attend(q, k_cache, v_cache)

    def rotary(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """``__call__`` of q and k before RoPE (cos, sin [num_tokens, 1, head_dim // 2]):
        the rotation and the KV write in one kernel on CUDA (kernels/rotary.py), the
        references elsewhere; the model calls it outside batch-invariant mode."""
        md = self.metadata
        k_cache, v_cache = self.kv_cache.k[layer_idx], self.kv_cache.v[layer_idx]
        return self._attend(rope_store(q, k, v, cos, sin, k_cache, v_cache, md.slot_mapping), k_cache, v_cache)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        md = self.metadata
        return paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                               self.scale, md.max_query_len, self.batch_invariant, md.tree_mask)
