"""The fused decoder-layer kernels (kernels/fused.py) against their PyTorch references:
residual add + RMSNorm, SiLU(gate) * up, in float32 and bfloat16, on ragged shapes.

If these fail, the model's GPU path (outside batch-invariant mode) computes another
residual stream, norm or MLP activation than the reference model does."""

import pytest
import torch

from kernels import fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: GPU, else the interpreter
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (3, 200), (0, 64)])
def test_add_rms_norm_matches_the_reference(dtype, rows, hidden):
    x, res = randn(rows, hidden, dtype=dtype, seed=1), randn(rows, hidden, dtype=dtype, seed=2) * 3
    weight = randn(hidden, dtype=dtype, seed=3)
    normed, summed = fused.add_rms_norm_triton(x, res, weight, 1e-6)
    want_normed, want_summed = fused.add_rms_norm_reference(x, res, weight, 1e-6)
    assert summed.dtype == normed.dtype == dtype and summed.shape == normed.shape == x.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    if dtype == torch.float32:
        assert torch.equal(summed, want_summed)  # the residual stream: one rounding, bit for bit
    else:  # (the CPU interpreter's float32 -> bf16 cast need not round to nearest like the GPU's)
        torch.testing.assert_close(summed.float(), want_summed.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(normed.float(), want_normed.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128), (7, 300), (2, 3, 1500), (0, 8)])
def test_silu_mul_matches_the_reference(dtype, shape):
    gate, up = randn(*shape, dtype=dtype, seed=4) * 4, randn(*shape, dtype=dtype, seed=5)
    got = fused.silu_mul_triton(gate, up)
    want = fused.silu_mul_reference(gate, up)
    assert got.dtype == dtype and got.shape == gate.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_reads_the_halves_of_one_fused_output_by_stride(dtype):
    """The model's gate/up is one matmul: gate and up are the two halves of its output rows,
    non-contiguous views, read in place (a kernel that assumed contiguous rows would read
    gate and up interleaved)."""
    gate_up = randn(5, 2 * 300, dtype=dtype, seed=6) * 4
    gate, up = gate_up.split(300, dim=-1)
    got = fused.silu_mul_triton(gate, up)
    assert got.shape == (5, 300) and got.is_contiguous()
    want = fused.silu_mul_reference(gate, up)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_dispatchers_take_the_reference_off_triton():
    """On tensors Triton does not run (the CPU without RHYMERL_TRITON), the references."""
    if fused.use_triton(torch.zeros(1)):
        pytest.skip("Triton runs here")
    x, res, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    for got, want in zip(fused.add_rms_norm(x, res, w, 1e-5), fused.add_rms_norm_reference(x, res, w, 1e-5)):
        assert torch.equal(got, want)
    assert torch.equal(fused.silu_mul(x, res), fused.silu_mul_reference(x, res))
