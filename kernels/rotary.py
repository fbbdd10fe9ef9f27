"""Rotary position embedding (RoPE), and RoPE fused with the KV cache's write.

``apply_rope`` is Hugging Face's rotation (pairs ``(i, i + head_dim / 2)``, the ``rotate_half``
layout), in the tensors' dtype: each product rounded to it, then the sum or difference.

``rope_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)`` is what a decoder layer's
attention does before attending: rotate q and k, write the rotated k and v at their cache
slots (slots < 0 are padding, skipped), and return the rotated q. The reference is
``apply_rope`` twice and ``kernels.paged_attention.write_kv``: about fifteen small kernels a
layer on a GPU (the halves, four products, a difference, a sum and a concatenation for q and
again for k, v's copy to contiguous rows, the write), each a launch even inside a CUDA
graph. ``rope_store_triton`` is one kernel per step and layer, one program per token: it
reads q, k and v by stride (views of the layer's fused q/k/v matmul output, no copies),
computes each element with the reference's roundings (the products rounded to the dtype
before the difference or sum, and no fused multiply-add), stores the rotated q and writes
k and v into the cache. The model uses it on CUDA outside batch-invariant mode
(``use_triton``, as ``kernels/fused.py``); the reference is the CPU path and the ground truth.

This module knows nothing about models or sequences: it sees tokens, heads and slots.
"""

from __future__ import annotations

import torch

from kernels.paged_attention import use_triton, write_kv

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates pairs (i, i + head_dim/2) of x [num_tokens, heads, head_dim] (the HF layout);
    cos, sin [num_tokens, 1, head_dim // 2] in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_store_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    write_kv(k.contiguous(), v.contiguous(), k_cache, v_cache, slot_mapping)
    return q


def rope_store_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    half = head_dim // 2
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0, (q.shape, k.shape)
    assert q.dtype == k.dtype == v.dtype == cos.dtype == sin.dtype, (q.dtype, k.dtype, v.dtype, cos.dtype)
    assert cos.shape == sin.shape and cos.shape[0] == num_tokens and cos.shape[-1] == half, cos.shape
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim), k_cache.shape
    assert k_cache.dtype == v_cache.dtype == q.dtype, (k_cache.dtype, q.dtype)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.shape == (num_tokens,)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and cos.stride(-1) == sin.stride(-1) == 1
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens:
        cos2, sin2 = cos.reshape(num_tokens, half), sin.reshape(num_tokens, half)
        _rope_store_kernel[(num_tokens,)](
            q, k, v, cos2, sin2, out, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos2.stride(0), sin2.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
            BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(half), enable_fp_fusion=False)
    return out


def rope_store(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """Rotates q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim]
    by cos, sin [num_tokens, 1, head_dim // 2], writes the rotated k and v at
    ``slot_mapping``'s cache slots (< 0: skipped) of k_cache, v_cache [num_blocks,
    block_size, num_kv_heads, head_dim]; returns the rotated q (a new contiguous tensor)."""
    if use_triton(q):
        return rope_store_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_store_reference(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


if triton is not None:

    @triton.jit
    def _rotate(ptr, row, stride_h, heads, c, s, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr,
                BLOCK_D: tl.constexpr):
        """One token's heads of q or k, rotated: the two halves [BLOCK_HEADS, BLOCK_D], each
        product and then the difference and sum rounded to the dtype, as apply_rope's ops."""
        h = tl.arange(0, BLOCK_HEADS)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        ok = (h < heads) & (d < HALF)
        at = ptr + row + h * stride_h + d
        x1 = tl.load(at, mask=ok, other=0.0)
        x2 = tl.load(at + HALF, mask=ok, other=0.0)
        dt = x1.dtype
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        lo = (f1 * c).to(dt).to(tl.float32) - (f2 * s).to(dt).to(tl.float32)
        hi = (f2 * c).to(dt).to(tl.float32) + (f1 * s).to(dt).to(tl.float32)
        return lo.to(dt), hi.to(dt), h, d, ok

    @triton.jit
    def _rope_store_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                           stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                           stride_cos, stride_sin,
                           NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        dd = tl.arange(0, BLOCK_D)[None, :]
        c = tl.load(cos_ptr + t * stride_cos + dd, mask=dd < HALF, other=0.0).to(tl.float32)  # [1, BLOCK_D]
        s = tl.load(sin_ptr + t * stride_sin + dd, mask=dd < HALF, other=0.0).to(tl.float32)
        head_dim = 2 * HALF
        # q: rotated into a new [num_tokens, num_heads, head_dim] tensor
        lo, hi, h, d, ok = _rotate(q_ptr, t * stride_qt, stride_qh, NUM_HEADS, c, s, BLOCK_H, HALF, BLOCK_D)
        at = out_ptr + t * (NUM_HEADS * head_dim) + h * head_dim + d
        tl.store(at, lo, mask=ok)
        tl.store(at + HALF, hi, mask=ok)
        # k rotated and v as it is, at the token's cache slot (a padding token's slot is < 0)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        lo, hi, h, d, ok = _rotate(k_ptr, t * stride_kt, stride_kh, NUM_KV_HEADS, c, s, BLOCK_KV, HALF, BLOCK_D)
        row = slot * (NUM_KV_HEADS * head_dim) + h * head_dim + d  # < 0 throughout for slot -1
        ok = ok & (row >= 0)
        tl.store(k_cache_ptr + row, lo, mask=ok)
        tl.store(k_cache_ptr + row + HALF, hi, mask=ok)
        src = v_ptr + t * stride_vt + h * stride_vh + d
        tl.store(v_cache_ptr + row, tl.load(src, mask=ok, other=0.0), mask=ok)
        tl.store(v_cache_ptr + row + HALF, tl.load(src + HALF, mask=ok, other=0.0), mask=ok)
