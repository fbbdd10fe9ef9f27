"""Batch-invariant linear layer: y = x @ weight.T + bias, each row's result independent
of how many rows are multiplied with it.

A library GEMM picks its algorithm from the shape: on the CPU, MKL runs one row as a
matrix-vector product, 2-3 rows and 4+ rows through other kernels, so a row's result
changes in its last bits with the number of rows; on the GPU cuBLAS changes tiles and
split-K. Here every call has one shape per row:
  - CPU (the reference): rows are multiplied in tiles of exactly ``ROW_TILE`` rows (the
    last tile zero-padded), so every row goes through the same MKL call of the same
    shape, whatever the batch.
  - GPU (Triton): one fixed tile configuration for every M, no split-K; each output is
    accumulated over K in the same order in every launch.

This module knows nothing about models: it sees a matrix and its weights.
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

ROW_TILE = 16  # rows per MKL call on the CPU: 8-16 cost least (benchmarks/batch_invariant_bench.py)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64  # the Triton tile: never a function of M


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row tiles of a fixed shape through torch's linear (MKL on the CPU)."""
    _check_args(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)  # [m, k]
    m = rows.shape[0]
    out = rows.new_empty(m, weight.shape[0])  # [m, n]
    tile = rows.new_zeros(ROW_TILE, k)  # [ROW_TILE, k], one aligned buffer for every call
    for start in range(0, m, ROW_TILE):
        n = min(ROW_TILE, m - start)
        tile[:n] = rows[start:start + n]
        if n < ROW_TILE:
            tile[n:] = 0
        out[start:start + n] = F.linear(tile, weight, bias)[:n]
    return out.view(*lead, weight.shape[0])


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    _check_args(x, weight, bias)
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)  # [m, n]
    if m > 0:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](
            rows, weight, bias if bias is not None else out, out, m, n, k,
            rows.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            DOT_F32=not x.is_cuda, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=4, num_stages=3,
        )
    return out.view(*lead, n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Batch-invariant ``F.linear``.

    Args:
        x: [..., k]
        weight: [n, k], same dtype and device as x.
        bias: [n] or None.
    Returns:
        [..., n] in x's dtype; row i depends only on x's row i (bit for bit).
    """
    if use_triton(x):
        return linear_triton(x, weight, bias)
    return linear_reference(x, weight, bias)


def _check_args(x, weight, bias) -> None:
    assert weight.dim() == 2 and x.shape[-1] == weight.shape[1], (x.shape, weight.shape)
    assert x.dtype == weight.dtype and x.device == weight.device, (x.dtype, weight.dtype, x.device, weight.device)
    assert weight.stride(1) == 1, weight.stride()
    if bias is not None:
        assert bias.shape == (weight.shape[0],) and bias.dtype == x.dtype, (bias.shape, bias.dtype)


if triton is not None:

    @triton.jit
    def _linear_kernel(
        x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
        stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        DOT_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # One K loop in one order for every launch: no split-K, no shape-dependent tiles.
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
            k_ok = ks < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK_K]
            if DOT_F32:  # Triton's CPU interpreter multiplies bf16 dot operands as raw bits
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
