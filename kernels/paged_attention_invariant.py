"""The PyTorch path of paged attention in batch-invariant mode (the CPU engine's).

Each query row's output is a function of its own query, its sequence's keys and values
at positions 0..its own, and nothing else: not the other rows of its sequence (decode,
verify with any number of drafts, a prefill chunk of any size), not the other
sequences, not the padding. That holds bit for bit because every reduction has a fixed
order that no shape of the batch enters:
  - keys are visited in tiles of ``KV_TILE`` positions starting at 0, with an online
    softmax; a tile a row cannot see changes its state by exact identities (x * 1 + 0);
  - sums run as fixed binary trees of elementwise adds (``tree_sum``), never through a
    BLAS call or a reduction kernel whose blocking depends on the tensor's shape;
  - rows are independent, so they are processed in chunks of ``ROW_CHUNK`` only to bound
    memory.
The default path (``paged_attention_reference``) batches sequences through matmuls and
is faster, but a row's last bits there depend on its batch mates.

A draft tree's rows (``tree_mask``, kernels/paged_attention.py) keep the same property:
a node at depth d sees the context and its d ancestors, which sit at scattered rows of
the query; here they are read as the contiguous positions they stand for (the k-th
visible row of the query at position q_base + k), so the node goes through exactly the
tiles and lanes of a plain decode of the same tokens, bit for bit.

This module knows nothing about sequences or models: it sees tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KV_TILE = 64  # key positions per online-softmax step
TREE_BITS = 63  # query rows a tree mask reaches (kernels/paged_attention.py)
ROW_CHUNK = 64  # query rows per pass (memory only: rows never interact)


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` as a fixed pairwise tree (zero-padded to a power of two) of
    elementwise adds: the result for each output depends only on its own inputs."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def paged_attention_invariant_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    tree_mask: torch.Tensor | None = None,  # [num_tokens] int64: rows of its query each row sees (-1: all)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] in q's dtype; rows past the last sequence are 0
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    cu = query_start_loc.long()
    query_lens = cu.diff()  # [num_seqs]
    num_rows = int(cu[-1]) if cu.numel() else 0
    if num_rows == 0:
        return out
    dev = q.device
    seq_of_row = torch.repeat_interleave(torch.arange(len(query_lens), device=dev), query_lens,
                                         output_size=num_rows)  # [num_rows]
    index_in_query = torch.arange(num_rows, device=dev) - cu[seq_of_row]  # [num_rows]
    q_base = (seq_lens.long() - query_lens)[seq_of_row]  # [num_rows], each row's query's first position
    positions = q_base + index_in_query  # [num_rows]
    # A tree row's ancestors (and itself) in depth order: offsets within the query of the
    # set bits of its mask, the k-th standing for position q_base + k.
    rank = None
    if tree_mask is not None:
        bits_at = torch.arange(TREE_BITS, device=dev)  # [TREE_BITS]
        masks = tree_mask[:num_rows]
        set_bits = ((torch.bitwise_right_shift(masks[:, None], bits_at[None, :]) & 1) != 0) \
            & (bits_at[None, :] <= index_in_query[:, None])  # [num_rows, TREE_BITS]
        tree_row = (masks != -1) & (index_in_query < TREE_BITS)  # [num_rows]
        rank = torch.where(set_bits, bits_at, TREE_BITS + bits_at).sort(dim=1).values  # [num_rows, TREE_BITS]
        depth = set_bits.sum(1) - 1
        positions = torch.where(tree_row, q_base + depth, positions)
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, kvh, d]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    width = block_tables.shape[1]
    for r0 in range(0, num_rows, ROW_CHUNK):
        rows = slice(r0, min(num_rows, r0 + ROW_CHUNK))
        pos = positions[rows]  # [r]
        tables = block_tables[seq_of_row[rows]].long()  # [r, width]
        n = pos.shape[0]
        qs = q[rows].float().view(n, num_kv_heads, group, 1, head_dim)
        m = torch.full((n, num_kv_heads, group), float("-inf"), device=dev)  # running max
        denom = torch.zeros(n, num_kv_heads, group, device=dev)  # running sum of exp
        acc = torch.zeros(n, num_kv_heads, group, head_dim, device=dev)  # running weighted sum of v
        for start in range(0, int(pos.max()) + 1, KV_TILE):
            kv_pos = start + torch.arange(KV_TILE, device=dev)  # [KV_TILE]
            visible = kv_pos[None, :] <= pos[:, None]  # [r, KV_TILE]
            where = kv_pos.expand(n, -1)  # [r, KV_TILE], the cache position each key is read from
            if rank is not None:  # a tree row's k-th key past its query's start: its k-th visible row
                k = kv_pos[None, :] - q_base[rows, None]  # [r, KV_TILE]
                in_tree = (k >= 0) & (k < TREE_BITS) & tree_row[rows, None]
                mapped = q_base[rows, None] + rank[rows].gather(1, k.clamp(0, TREE_BITS - 1))
                where = torch.where(in_tree, mapped, where)
            blocks = tables.gather(1, (where // block_size).clamp(max=width - 1))  # [r, KV_TILE]
            slots = blocks * block_size + where % block_size  # [r, KV_TILE]
            # Invisible slots may hold anything (other sequences' KV, even NaN): their scores
            # are replaced by -inf below, and their values zeroed, so that a zero
            # probability times them is an exact 0.
            k = k_flat[slots].float()  # [r, KV_TILE, kvh, d]
            v = v_flat[slots].float().where(visible[..., None, None], 0.0)
            k = k.permute(0, 2, 1, 3)[:, :, None]  # [r, kvh, 1, KV_TILE, d]
            v = v.permute(0, 2, 1, 3)[:, :, None]  # [r, kvh, 1, KV_TILE, d]
            scores = tree_sum(qs * k, -1) * scale  # [r, kvh, group, KV_TILE]
            scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
            m_new = torch.maximum(m, scores.amax(-1))  # [r, kvh, group]; finite: position 0 is in tile 0
            alpha = torch.exp(m - m_new)  # 1 exactly where the tile adds nothing
            probs = torch.exp(scores - m_new[..., None])  # [r, kvh, group, KV_TILE]
            denom = denom * alpha + tree_sum(probs, -1)
            acc = acc * alpha[..., None] + tree_sum(probs[..., None] * v, -2)
            m = m_new
        out[rows] = (acc / denom[..., None]).view(n, num_heads, head_dim).to(q.dtype)
    return out
