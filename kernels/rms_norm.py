"""Batch-invariant RMSNorm: y = weight * (x * rsqrt(mean(x^2) + eps)), one row at a time.

Normalised in float32 and scaled in the input dtype, as Hugging Face's Llama/Qwen norms
do. The Triton kernel is one program per row with one fixed block over the hidden size,
so a row's sum of squares is reduced in the same order whatever the batch (a library
norm may change its reduction with the number of rows). The PyTorch reference is the
model's own formula; on the CPU its reduction is already per row.

This module knows nothing about models: it sees rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_attention import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.dtype == x.dtype and weight.device == x.device
    rows = x.reshape(-1, hidden)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [num_rows, hidden]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), hidden, eps,
                                           BLOCK=triton.next_power_of_2(hidden))
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Args: x [..., hidden]; weight [hidden]. Returns [..., hidden] in x's dtype."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, hidden, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)  # [BLOCK]
        mean_sq = tl.sum(x * x, axis=0) / hidden
        # Rounded to the output dtype before the scale, as the model's formula does; the
        # product itself in float32 (one rounding, like torch's bf16 multiply).
        normed = (x * tl.math.rsqrt(mean_sq + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)
