"""Paged attention over a block-table KV cache: KV write and causal ragged attention.

One call serves decode (1 query token per sequence), speculative verify (1 + K tokens,
K different per sequence) and chunked prefill: sequence s owns the query rows
``query_start_loc[s]:query_start_loc[s + 1]``, which are its newest tokens, and their
KV is already in the cache (``write_kv`` runs first). Query row i of sequence s sits at
position ``seq_lens[s] - query_len_s + i`` and sees cache positions up to its own.

With a ``tree_mask`` (a draft tree's verify, services/rollout/engine/tree.py) row i sees
the positions before its sequence's query and, among its query's rows j <= i, only those
whose bit j is set in ``tree_mask[row]`` (its ancestors and itself); a row whose mask is
-1 is causal as without one. Bits reach query rows 0..62: rows past that see causally.

This module knows nothing about sequences, schedulers or models: it sees tensors.
Each op has a Triton kernel, a checked wrapper (``*_triton``), a PyTorch reference
(``*_reference``, the ground truth) and a dispatcher that picks between them. On a CPU
the dispatcher runs decode and verify steps (float32, queries of up to 64 rows, no tree)
through the compiled passes of ``kernels/paged_attention_native.py``, which read the KV
cache in place instead of gathering it, and everything else through the reference.
"""

from __future__ import annotations

import os

import torch

from kernels.paged_attention_invariant import paged_attention_invariant_reference
from kernels.paged_attention_native import paged_attention_native

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None


def use_triton(t: torch.Tensor) -> bool:
    """Triton on CUDA tensors; on CPU only when asked (RHYMERL_TRITON=1, run it with
    TRITON_INTERPRET=1), because the interpreter is orders of magnitude slower."""
    if triton is None:
        return False
    return t.is_cuda or os.environ.get("RHYMERL_TRITON") == "1"


# ---------------------------------------------------------------------------- write_kv


def write_kv_reference(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, < 0 = skip
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2:]
    keep = slot_mapping >= 0  # [num_tokens]
    slots = slot_mapping[keep]  # [num_kept]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = v[keep].to(v_cache.dtype)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    _check_kv_args(k, v, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    row_size = num_kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), v.stride(0),
        ROW_SIZE=row_size, BLOCK=triton.next_power_of_2(row_size),
    )


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store the new tokens' K and V at their cache slots (slot = block_id * block_size
    + offset); slots < 0 are padding and are skipped."""
    if use_triton(k):
        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_reference(k, v, k_cache, v_cache, slot_mapping)


def _check_kv_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape, (v.shape, k.shape)
    assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim), k_cache.shape
    assert v_cache.shape == k_cache.shape, (v_cache.shape, k_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    # Each token's [num_kv_heads, head_dim] must be one contiguous row of memory.
    for t in (k, v):
        assert t.stride(2) == 1 and t.stride(1) == head_dim, t.stride()
    assert k.dtype == v.dtype and k_cache.dtype == v_cache.dtype
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert k.device == k_cache.device == slot_mapping.device


# ---------------------------------------------------------------------- paged_attention


def paged_attention_reference(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int | None = None,
    tree_mask: torch.Tensor | None = None,  # [num_tokens] int64, see the module's docstring
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] in q's dtype
    """Gather the sequences' contexts from their blocks into dense, padded K/V and attend
    in float32, a batch of sequences per matmul (no Python loop over sequences).

    Sequences with short queries (decode, verify) go together, padded to the longest
    query and context of their group; each long query (a prefill chunk) goes alone, so
    padding never costs more than a few short rows. Rows past query_start_loc[-1] and
    sequences with query length 0 are left at 0."""
    out = torch.zeros_like(q)
    num_seqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_seqs == 0:
        return out
    context_lens = seq_lens.tolist()
    cu_q = query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    short = [s for s in range(num_seqs) if 0 < query_lens[s] <= _SHORT_QUERY]
    groups = [short[i:i + _MAX_GROUP] for i in range(0, len(short), _MAX_GROUP)]
    groups += [[s] for s in range(num_seqs) if query_lens[s] > _SHORT_QUERY]
    for group in groups:
        _attend_group(q, k_cache, v_cache, block_tables, group, [cu_q[s] for s in group],
                      [query_lens[s] for s in group], [context_lens[s] for s in group], scale, out, tree_mask)
    return out


TREE_BITS = 63  # query rows a tree mask reaches (bits of an int64 but its sign)


def tree_visible(row_masks: torch.Tensor, query_offsets: torch.Tensor) -> torch.Tensor:
    """Whether a key at query offset j (its position minus the query's first) is allowed by
    a row's tree mask: bit j set, or j outside [0, TREE_BITS) (the context before the query,
    or rows no mask reaches). Broadcasts ``row_masks`` (int64) against ``query_offsets``."""
    outside = (query_offsets < 0) | (query_offsets >= TREE_BITS)
    bit = torch.bitwise_right_shift(row_masks, query_offsets.clamp(0, TREE_BITS - 1)) & 1
    return outside | (bit != 0)


_SHORT_QUERY = 64  # query rows up to which a sequence is batched with the others
_MAX_GROUP = 256  # sequences per batched matmul (bounds the padded scores' memory)


def _attend_group(q, k_cache, v_cache, block_tables, seqs: list[int], starts: list[int], query_lens: list[int],
                  context_lens: list[int], scale: float, out: torch.Tensor,
                  tree_mask: torch.Tensor | None = None) -> None:
    """Causal attention of the sequences ``seqs``, all at once over dense padded K/V."""
    num_heads, head_dim = q.shape[1:]
    block_size, num_kv_heads = k_cache.shape[1:3]
    group = num_heads // num_kv_heads
    dev = q.device
    n, max_q, max_ctx = len(seqs), max(query_lens), max(context_lens)
    num_blocks = -(-max_ctx // block_size)
    seq_idx = torch.tensor(seqs, device=dev)
    ctx = torch.tensor(context_lens, device=dev)  # [n]
    qlen = torch.tensor(query_lens, device=dev)  # [n]
    tables = block_tables[seq_idx, :num_blocks].long()  # [n, num_blocks]
    # Dense K/V, [n, kvh, max_ctx, d]; slots past a sequence's context are zeroed (they
    # hold other sequences' KV or garbage, which a 0 probability must not turn into NaN).
    kv_pos = torch.arange(max_ctx, device=dev)  # [max_ctx]
    kv_ok = (kv_pos[None, :] < ctx[:, None])[:, None, :, None]  # [n, 1, max_ctx, 1]
    k = k_cache[tables].reshape(n, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_ctx]
    v = v_cache[tables].reshape(n, num_blocks * block_size, num_kv_heads, head_dim)[:, :max_ctx]
    k = k.float().transpose(1, 2).where(kv_ok, 0.0)  # [n, kvh, max_ctx, d]
    v = v.float().transpose(1, 2).where(kv_ok, 0.0)  # [n, kvh, max_ctx, d]
    # Padded queries, [n, kvh, max_q * group, d]: row (i, g) is query token i, head kvh * group + g.
    q_idx = torch.arange(max_q, device=dev)  # [max_q]
    q_ok = q_idx[None, :] < qlen[:, None]  # [n, max_q]
    rows = torch.tensor(starts, device=dev)[:, None] + q_idx[None, :]  # [n, max_q]
    rows = rows.where(q_ok, 0)
    qs = q[rows].float().view(n, max_q, num_kv_heads, group, head_dim)
    qs = qs.permute(0, 2, 1, 3, 4).reshape(n, num_kv_heads, max_q * group, head_dim)
    # Query token i of a sequence sits at position ctx - qlen + i and sees keys up to it
    # (padding rows see the whole context: finite, and discarded).
    q_pos = (ctx - qlen)[:, None] + q_idx[None, :]  # [n, max_q]
    visible = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < ctx[:, None, None])
    if tree_mask is not None:  # a tree's rows see their ancestors only among the query's rows
        offsets = kv_pos[None, None, :] - (ctx - qlen)[:, None, None]  # [n, 1, max_ctx]
        visible &= tree_visible(tree_mask[rows].where(q_ok, -1)[:, :, None], offsets)
    visible = visible[:, None, :, None, :].expand(n, 1, max_q, group, max_ctx).reshape(n, 1, max_q * group, max_ctx)
    scores = torch.matmul(qs, k.transpose(-1, -2)) * scale  # [n, kvh, max_q * group, max_ctx]
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    o = torch.matmul(probs, v)  # [n, kvh, max_q * group, d]
    o = o.view(n, num_kv_heads, max_q, group, head_dim).permute(0, 2, 1, 3, 4).reshape(n, max_q, num_heads, head_dim)
    out[rows[q_ok]] = o[q_ok].to(out.dtype)


def paged_attention_triton(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
    max_query_len: int | None = None, num_kv_splits: int | None = None, batch_invariant: bool = False,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton path; ``num_kv_splits`` overrides the split-KV heuristic (tests).

    Batch-invariant mode fixes everything a query row's reduction order could depend
    on: the row tile (``INVARIANT_BLOCK_M``), the split size (``KV_SPLIT_TOKENS`` key
    positions per split, from position 0, however many sequences share the GPU), and a
    merge that adds the splits one by one in order (splits past a row's context add
    exact zeros). The number of splits launched only has to cover the block tables'
    width, which is fixed under CUDA graphs."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    num_seqs = seq_lens.shape[0]
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert q.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype)
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.stride(1) == 1
    assert block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    assert query_start_loc.shape == (num_seqs + 1,)
    assert q.device == k_cache.device == block_tables.device == seq_lens.device == query_start_loc.device
    if tree_mask is not None:
        assert tree_mask.shape == (num_tokens,) and tree_mask.dtype == torch.int64, (tree_mask.shape, tree_mask.dtype)
        assert tree_mask.device == q.device
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    group = num_heads // num_kv_heads
    # A tile's rows are (query token, head of the group) pairs sharing one KV head, so
    # decode with GQA fills the tile with the group's heads instead of padding.
    block_m = max(16, min(64, triton.next_power_of_2(max_query_len * group)))
    num_m_tiles = triton.cdiv(max_query_len * group, block_m)
    if batch_invariant:
        block_m = INVARIANT_BLOCK_M
        assert group <= block_m, (group, block_m)
        # Tiles of whole tokens aligned to absolute positions: a query may straddle one more.
        num_m_tiles = triton.cdiv(max_query_len, block_m // group) + 1
        num_kv_splits = triton.cdiv(block_tables.shape[1] * block_size, KV_SPLIT_TOKENS)
    if num_kv_splits is None:
        num_kv_splits = _num_kv_splits(q.device, num_seqs * num_kv_heads * num_m_tiles)
    merge = num_kv_splits > 1 or batch_invariant
    block_d = triton.next_power_of_2(head_dim)
    # With several splits each program leaves a normalised partial output and its
    # log2-sum-exp; _merge_splits_kernel combines them (flash-decoding).
    part_out = torch.empty(num_kv_splits if merge else 0, num_tokens, num_heads, block_d,
                           dtype=torch.float32, device=q.device)  # [splits, num_tokens, num_heads, block_d]
    part_lse = torch.empty(part_out.shape[:3], dtype=torch.float32, device=q.device)  # [splits, num_tokens, num_heads]
    # Rows past query_start_loc[-1] (CUDA-graph padding) belong to no sequence: the extra
    # program after the last sequence (or the merge) writes 0 there, without a memset.
    grid = (num_seqs + 1, num_kv_heads, num_m_tiles * num_kv_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, query_start_loc,
        tree_mask if tree_mask is not None else seq_lens,  # (not read without a mask)
        scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        num_tokens * num_heads, num_heads, num_seqs, num_tokens,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=64 if head_dim <= 128 else 32,
        NUM_KV_SPLITS=num_kv_splits, MERGE=merge, INVARIANT=batch_invariant, SPLIT_TOKENS=KV_SPLIT_TOKENS,
        HAS_TREE=tree_mask is not None, TREE_BITS=TREE_BITS,
        # Triton's CPU interpreter multiplies bf16 dot operands as their raw uint16 bits.
        DOT_F32=not q.is_cuda,
        # float32 caches (tests, debugging) get exact products, not TF32.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    if merge:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out, part_lse, out, query_start_loc, out.stride(0), out.stride(1),
            num_tokens * num_heads, num_heads, num_seqs,
            HEAD_DIM=head_dim, BLOCK_D=block_d,
            NUM_KV_SPLITS=num_kv_splits, BLOCK_S=triton.next_power_of_2(num_kv_splits), IN_ORDER=batch_invariant,
        )
    return out


INVARIANT_BLOCK_M = 64  # batch-invariant mode: one row tile for decode, verify and prefill alike
KV_SPLIT_TOKENS = 512  # batch-invariant mode: key positions per split (a multiple of BLOCK_N)
_SM_COUNT: dict[int, int] = {}


def _num_kv_splits(device: torch.device, num_programs: int) -> int:
    """Split each context across programs when the batch alone cannot fill the GPU
    (small-batch decode). Depends only on shapes, so CUDA graph replays stay valid."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(16, 2 * _SM_COUNT[index] // num_programs))


def paged_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
    max_query_len: int | None = None, batch_invariant: bool = False, tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the ragged query rows over their sequences' paged KV.

    Args:
        q: [num_tokens, num_heads, head_dim]; rows query_start_loc[s]:query_start_loc[s+1]
            are sequence s's newest tokens.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], already holding
            the new tokens' KV.
        block_tables: [num_seqs, max_blocks_per_seq] int32.
        seq_lens: [num_seqs] int32, context length including the new tokens.
        query_start_loc: [num_seqs + 1] int32.
        scale: softmax scale, usually head_dim ** -0.5.
        max_query_len: the largest query_len, if the caller knows it (saves a device sync).
        batch_invariant: make each query row's output bitwise independent of its batch
            mates, its sequence's other query rows and the padding (see
            ``paged_attention_triton`` and ``kernels/paged_attention_invariant.py``).
        tree_mask: [num_tokens] int64 or None, the rows of its query each row may see
            (a draft tree's verify; see the module's docstring).

    Returns:
        [num_tokens, num_heads, head_dim] in q's dtype.
    """
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len)
    if use_triton(q):
        return paged_attention_triton(*args, batch_invariant=batch_invariant, tree_mask=tree_mask)
    if batch_invariant:
        return paged_attention_invariant_reference(*args[:7], tree_mask=tree_mask)
    out = paged_attention_native(*args, tree_mask=tree_mask)  # the CPU's decode and verify steps
    return out if out is not None else paged_attention_reference(*args, tree_mask=tree_mask)


# ------------------------------------------------------------------------ Triton kernels

if triton is not None:

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
        stride_k_tok, stride_v_tok,
        ROW_SIZE: tl.constexpr, BLOCK: tl.constexpr,
    ):
        token = tl.program_id(0)
        slot = tl.load(slot_ptr + token)
        if slot >= 0:
            cols = tl.arange(0, BLOCK)
            mask = cols < ROW_SIZE
            k = tl.load(k_ptr + token * stride_k_tok + cols, mask=mask)
            v = tl.load(v_ptr + token * stride_v_tok + cols, mask=mask)
            dst = slot * ROW_SIZE + cols
            tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        block_tables_ptr, seq_lens_ptr, cu_q_ptr, tree_mask_ptr,
        scale_log2,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_c_block, stride_c_slot, stride_c_head, stride_bt_seq,
        rows_per_split, num_heads, num_seqs, num_tokens,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        NUM_KV_SPLITS: tl.constexpr, MERGE: tl.constexpr, INVARIANT: tl.constexpr, SPLIT_TOKENS: tl.constexpr,
        HAS_TREE: tl.constexpr, TREE_BITS: tl.constexpr,
        DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        tile = tl.program_id(2) // NUM_KV_SPLITS
        split = tl.program_id(2) % NUM_KV_SPLITS
        q_start = tl.load(cu_q_ptr + seq)
        # The program after the last sequence (seq == num_seqs) has query_len 0: it only
        # zeroes the padding rows (unless the merge kernel writes them).
        query_len = tl.load(cu_q_ptr + tl.minimum(seq + 1, num_seqs)) - q_start
        if not MERGE:
            if (seq == num_seqs) & (tl.program_id(2) == 0):
                _zero_rows(out_ptr, q_start, num_tokens, kv_head * GROUP, stride_o_tok, stride_o_head,
                           GROUP, HEAD_DIM, BLOCK_D, BLOCK_M)
        context_len = tl.load(seq_lens_ptr + tl.minimum(seq, num_seqs - 1))
        if INVARIANT:
            # Tiles hold whole query tokens and start at absolute positions that are
            # multiples of TOKENS: a row sits at the same place in its tile (and so goes
            # through the same lanes of every dot) whatever its query's length.
            TOKENS: tl.constexpr = BLOCK_M // GROUP
            first_tile = (context_len - query_len) // TOKENS
            has_work = (query_len > 0) & ((first_tile + tile) * TOKENS < context_len)
        else:
            has_work = tile * BLOCK_M < query_len * GROUP
        if has_work:
            if INVARIANT:
                r = tl.arange(0, BLOCK_M)  # [BLOCK_M]
                q_pos = (first_tile + tile) * TOKENS + r // GROUP  # [BLOCK_M], absolute positions
                token = q_pos - (context_len - query_len)  # [BLOCK_M], index within the sequence's query
                head = kv_head * GROUP + r % GROUP  # [BLOCK_M]
                row_ok = (r < TOKENS * GROUP) & (token >= 0) & (token < query_len)
                last_pos = tl.minimum((first_tile + tile + 1) * TOKENS - 1, context_len - 1)
            else:
                rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
                token = rows // GROUP  # [BLOCK_M], index within the sequence's query
                head = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
                row_ok = token < query_len
                q_pos = context_len - query_len + token  # [BLOCK_M]
                last_pos = tl.minimum(context_len - query_len + (tile * BLOCK_M + BLOCK_M - 1) // GROUP,
                                      context_len - 1)
            dims = tl.arange(0, BLOCK_D)
            dim_ok = dims < HEAD_DIM
            q_off = (q_start + token)[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
            q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
            if DOT_F32:
                q = q.to(tl.float32)
            if HAS_TREE:  # each row's bitmask of the query rows it sees (-1: causal)
                row_mask = tl.load(tree_mask_ptr + q_start + token, mask=row_ok, other=-1)  # [BLOCK_M] int64
                q_base = context_len - query_len  # the position of the query's first row

            # Keys past the tile's last query position are masked for every row; the
            # remaining key tiles are cut into NUM_KV_SPLITS contiguous runs, one per program.
            if INVARIANT:  # split boundaries fixed in absolute positions
                n_begin = split * SPLIT_TOKENS
                n_end = tl.minimum(n_begin + SPLIT_TOKENS, last_pos + 1)
            else:
                tiles_per_split = tl.cdiv(tl.cdiv(last_pos + 1, BLOCK_N), NUM_KV_SPLITS)
                n_begin = split * tiles_per_split * BLOCK_N
                n_end = tl.minimum(n_begin + tiles_per_split * BLOCK_N, last_pos + 1)

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for start_n in range(n_begin, n_end, BLOCK_N):
                k_pos = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N]
                k_ok = k_pos < n_end
                block = tl.load(block_tables_ptr + seq * stride_bt_seq + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
                kv_off = (block.to(tl.int64) * stride_c_block + (k_pos % BLOCK_SIZE) * stride_c_slot
                          + kv_head * stride_c_head)  # [BLOCK_N]
                kv_mask = k_ok[:, None] & dim_ok[None, :]
                kv_ptrs = kv_off[:, None] + dims[None, :]  # [BLOCK_N, BLOCK_D]
                k = tl.load(k_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
                v = tl.load(v_cache_ptr + kv_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
                if DOT_F32:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
                visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
                if HAS_TREE:  # among the query's rows, only those in the row's mask
                    j = k_pos - q_base  # [BLOCK_N], query offsets
                    outside = (j < 0) | (j >= TREE_BITS)
                    shift = tl.minimum(tl.maximum(j, 0), TREE_BITS - 1).to(tl.int64)
                    bit = (row_mask[:, None] >> shift[None, :]) & 1  # [BLOCK_M, BLOCK_N]
                    visible = visible & ((bit != 0) | outside[None, :])
                s = tl.where(visible, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                # A row may have seen no visible key yet (causal mask): keep exp2 finite.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                m_i = m_new
            # Every row sees position 0, so l_i > 0 except in later splits with no visible key.
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # [BLOCK_M, BLOCK_D]
            if not MERGE:
                o_off = (q_start + token)[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
                tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
            else:
                part_row = split * rows_per_split + (q_start + token) * num_heads + head  # [BLOCK_M]
                tl.store(part_out_ptr + part_row[:, None] * BLOCK_D + dims[None, :], out, mask=row_ok[:, None])
                seen = l_i > 0.0
                lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # [BLOCK_M]
                tl.store(part_lse_ptr + part_row, lse, mask=row_ok)

    @triton.jit
    def _zero_rows(out_ptr, row_begin, row_end, first_head, stride_o_tok, stride_o_head,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
        """out[row_begin:row_end, first_head:first_head + NUM_HEADS] = 0."""
        dims = tl.arange(0, BLOCK_D)
        zeros = tl.zeros([BLOCK_M, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty)
        for start in range(row_begin, row_end, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
            mask = (rows < row_end)[:, None] & (dims < HEAD_DIM)[None, :]
            for h in tl.static_range(NUM_HEADS):
                off = rows[:, None] * stride_o_tok + (first_head + h) * stride_o_head + dims[None, :]
                tl.store(out_ptr + off, zeros, mask=mask)

    @triton.jit
    def _merge_splits_kernel(
        part_out_ptr, part_lse_ptr, out_ptr, cu_q_ptr, stride_o_tok, stride_o_head,
        rows_per_split, num_heads, num_seqs,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_KV_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
        IN_ORDER: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, BLOCK_S)
        # Padding rows (past the last sequence) read nothing and come out as 0.
        num_real_splits = tl.where(token < tl.load(cu_q_ptr + num_seqs), NUM_KV_SPLITS, 0)
        split_ok = splits < num_real_splits
        part_row = splits * rows_per_split + token * num_heads + head  # [BLOCK_S]
        lse = tl.load(part_lse_ptr + part_row, mask=split_ok, other=float("-inf"))  # [BLOCK_S]
        # Split 0 holds position 0, so the max is finite for every real query row.
        lse_max = tl.max(lse, axis=0)
        weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # [BLOCK_S]
        dims = tl.arange(0, BLOCK_D)
        if IN_ORDER:
            # One split after the other: splits past the row's context weigh 0 and add
            # exact zeros, so the result does not depend on how many were launched.
            lse_ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
            acc = tl.zeros([BLOCK_D], tl.float32)
            weight_sum = tl.zeros([], tl.float32)
            for s in range(0, num_real_splits):
                row = s * rows_per_split + token * num_heads + head
                w = tl.exp2(tl.load(part_lse_ptr + row) - lse_ref)
                acc += tl.where(w > 0, tl.load(part_out_ptr + row * BLOCK_D + dims) * w, 0.0)
                weight_sum += w
            out = acc / tl.where(weight_sum == 0.0, 1.0, weight_sum)  # [BLOCK_D]
        else:
            part = tl.load(part_out_ptr + part_row[:, None] * BLOCK_D + dims[None, :],
                           mask=split_ok[:, None] & (weight > 0)[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
            weight_sum = tl.sum(weight, axis=0)
            out = tl.sum(part * weight[:, None], axis=0) / tl.where(weight_sum == 0.0, 1.0, weight_sum)  # [BLOCK_D]
        tl.store(out_ptr + token * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_DIM)
