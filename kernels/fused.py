"""Fused elementwise kernels of the decoder layer: residual add + RMSNorm, SiLU(gate) * up.

Each replaces separate PyTorch ops (and their launches and round trips through memory)
with one kernel that does the same arithmetic in the same dtype steps:
  - ``add_rms_norm(x, residual, weight, eps)``: ``residual + x`` rounded to the input dtype
    (the new residual stream), then normalised in float32, rounded, and scaled by
    ``weight`` (Hugging Face's RMSNorm, as ``kernels/rms_norm.py``);
  - ``silu_mul(gate, up)``: ``F.silu(gate) * up``, SiLU computed in float32 and rounded to
    the input dtype before the product (as torch does on a GPU); gate and up are read by
    row stride, so the two halves of the model's fused gate/up matmul need no copy.
Results equal the references to rounding (the norm's sum and the exponential may round
differently), not bit for bit, so the model uses them only outside batch-invariant mode,
on CUDA (``use_triton``); the PyTorch references are the ground truth and the CPU path.

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


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = residual + x
    return weight * F.rms_norm(summed.float(), weight.shape, eps=eps).to(x.dtype), summed


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def add_rms_norm_triton(x, residual, weight, eps):
    hidden = x.shape[-1]
    assert x.shape == residual.shape and x.dtype == residual.dtype == weight.dtype, (x.shape, residual.shape)
    assert weight.shape == (hidden,) and x.device == residual.device == weight.device
    rows, res = x.reshape(-1, hidden).contiguous(), residual.reshape(-1, hidden).contiguous()
    normed, summed = torch.empty_like(rows), torch.empty_like(rows)  # [num_rows, hidden]
    if rows.shape[0]:
        _add_rms_norm_kernel[(rows.shape[0],)](rows, res, weight, normed, summed, hidden, eps,
                                               BLOCK=triton.next_power_of_2(hidden))
    return normed.view(x.shape), summed.view(x.shape)


def silu_mul_triton(gate, up):
    assert gate.shape == up.shape and gate.dtype == up.dtype and gate.device == up.device, (gate.shape, up.shape)
    cols = gate.shape[-1]
    # Rows are read by stride: gate and up may be the two halves of one fused matmul's output.
    g, u = (t.reshape(-1, cols) for t in (gate, up))
    g, u = (t if t.stride(-1) == 1 else t.contiguous() for t in (g, u))
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)  # [rows, cols]
    if out.numel():
        grid = (g.shape[0], triton.cdiv(cols, _ELEMENTWISE_BLOCK))
        _silu_mul_kernel[grid](g, u, out, cols, g.stride(0), u.stride(0), BLOCK=_ELEMENTWISE_BLOCK)
    return out.view(gate.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Args: x, residual [..., hidden] (same dtype); weight [hidden].
    Returns (normed, residual + x), both [..., hidden] in x's dtype."""
    if use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, elementwise; gate and up of one shape and dtype."""
    if use_triton(gate):
        return silu_mul_triton(gate, up)
    return silu_mul_reference(gate, up)


_ELEMENTWISE_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, normed_ptr, summed_ptr, hidden, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < hidden
        offs = row * hidden + cols
        x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        summed = (r + x).to(summed_ptr.dtype.element_ty)  # the residual stream, rounded like torch's add
        tl.store(summed_ptr + offs, summed, mask=ok)
        s = summed.to(tl.float32)
        mean_sq = tl.sum(s * s, axis=0) / hidden
        normed = (s * tl.math.rsqrt(mean_sq + eps)).to(normed_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(normed_ptr + offs, (w * normed).to(normed_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, cols, stride_g, stride_u, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < cols
        g = tl.load(gate_ptr + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
        silu = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * cols + offs, (silu * u).to(out_ptr.dtype.element_ty), mask=ok)
