"""Batch-invariant linear and RMSNorm: Triton == PyTorch reference (to rounding), and a
row's result is bit for bit the same however many rows are computed with it.

If these fail, batch-invariant mode stops being bitwise: a sequence's logits would move
with its batch mates, and a trainer recomputing logprobs would not get the rollout's.
(Paged attention's batch-invariant mode is tested in test_paged_attention.py.)"""

import pytest
import torch
import torch.nn.functional as F

from kernels import matmul, rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: GPU, else the interpreter
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rows_with_probe(num_rows: int, index: int, probe: torch.Tensor, seed: int) -> torch.Tensor:
    """num_rows random rows with ``probe`` at row ``index``."""
    x = torch.randn(num_rows, probe.shape[0], generator=torch.Generator().manual_seed(seed)).to(probe.dtype)
    x[index] = probe
    return x


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_reference_linear_row_is_independent_of_the_number_of_rows(bias):
    """CPU path: 1, 2, 3, 5, 64, 65 or 200 rows, the probe anywhere: the same bits."""
    gen = torch.Generator().manual_seed(0)
    weight, b = torch.randn(96, 80, generator=gen), torch.randn(96, generator=gen) if bias else None
    probe = torch.randn(80, generator=gen)
    alone = matmul.linear_reference(probe[None], weight, b)[0]
    torch.testing.assert_close(alone, F.linear(probe, weight, b), atol=1e-5, rtol=1e-5)
    for num_rows, index in ((2, 1), (3, 0), (5, 4), (64, 37), (65, 64), (200, 130)):
        x = rows_with_probe(num_rows, index, probe, seed=num_rows)
        out = matmul.linear_reference(x, weight, b)
        assert torch.equal(out[index], alone), (num_rows, index)
        torch.testing.assert_close(out, F.linear(x, weight, b), atol=1e-5, rtol=1e-5)
    assert matmul.linear_reference(torch.randn(2, 3, 80), weight, b).shape == (2, 3, 96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_linear_matches_torch_and_is_row_invariant(dtype):
    """The Triton kernel equals F.linear to rounding, and a row's bits depend neither on
    M (tiles launched) nor on the other rows of its tile. (Triton's CPU interpreter runs
    tile products through numpy, whose result for a row depends on the row's place in
    the tile, so off the GPU the probe keeps its place: index 6 of a 64-row tile.)"""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(100, 72, generator=gen).to(dtype)
    b = torch.randn(100, generator=gen).to(dtype)
    probe = torch.randn(72, generator=gen).to(dtype)
    outs = []
    for num_rows, index in ((7, 6), (64, 6), (70, 6), (150, 70)):
        x = rows_with_probe(num_rows, index, probe, seed=num_rows)
        out = matmul.linear_triton(x.to(DEVICE), weight.to(DEVICE), b.to(DEVICE)).cpu()
        assert out.dtype == dtype and out.shape == (num_rows, 100)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float(), b.float()), atol=tol * 10,
                                   rtol=tol)
        outs.append(out[index])
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_rms_norm_triton_matches_reference_and_is_row_invariant(dtype):
    """One program per row: the same bits for a row alone or among 50, equal to the
    model's formula to rounding."""
    gen = torch.Generator().manual_seed(2)
    weight = (1 + 0.1 * torch.randn(300, generator=gen)).to(dtype)
    probe = torch.randn(300, generator=gen).to(dtype)
    x = rows_with_probe(50, 17, probe, seed=3)
    many = rms_norm.rms_norm_triton(x.to(DEVICE), weight.to(DEVICE), 1e-6).cpu()
    alone = rms_norm.rms_norm_triton(probe[None].to(DEVICE), weight.to(DEVICE), 1e-6).cpu()
    assert torch.equal(many[17], alone[0])
    ref = rms_norm.rms_norm_reference(x, weight, 1e-6)
    torch.testing.assert_close(many.float(), ref.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    ref_alone = rms_norm.rms_norm_reference(probe[None], weight, 1e-6)
    assert torch.equal(ref[17], ref_alone[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_linear_row_invariant_at_any_place_and_any_m():
    """On the GPU the probe may sit anywhere in any of 1..512 rows: the same bits."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(4864, 896, generator=gen).bfloat16().cuda()
    probe = torch.randn(896, generator=gen).bfloat16().cuda()
    alone = matmul.linear(probe[None], weight)[0]
    for num_rows in (2, 3, 17, 64, 65, 255, 512):
        index = (7 * num_rows) % num_rows
        x = rows_with_probe(num_rows, index, probe.cpu(), seed=num_rows).cuda()
        assert torch.equal(matmul.linear(x, weight)[index], alone), num_rows
