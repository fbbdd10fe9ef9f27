"""The Triton kernels at the sizes a GPU worker serves, against their PyTorch references.

tests/kernels checks every case at small sizes (on the GPU when there is one); these add
what only the GPU reaches: Qwen-sized heads and contexts, the split-KV path the GPU picks
for small batches, replay from a CUDA graph, and a 151,936-token vocabulary. If they fail,
decode and verify disagree at scale and speculation stops being lossless there.
"""

from __future__ import annotations

import pytest
import torch

from kernels import paged_attention as pa
from kernels import sampling as sp

pytestmark = pytest.mark.gpu

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (num_heads, num_kv_heads, head_dim): Qwen2.5-0.5B, -7B
HEADS = [pytest.param((14, 2, 64), id="14-2-64"), pytest.param((28, 4, 128), id="28-4-128")]
# a decode, a ragged verify and a prefill chunk in one batch, contexts up to 2,048
CONTEXT_LENS, QUERY_LENS = [2048, 1, 513, 900, 17, 1500], [1, 1, 9, 16, 17, 300]


def kernel_tests():
    """tests/kernels' batch builders and tolerances, imported when a test runs: imported at
    collection, the CPU suite would reuse those modules bound to kernels decorated before
    tests/kernels/conftest.py switches to Triton's interpreter."""
    from tests.kernels import test_paged_attention, test_sampling

    return test_paged_attention, test_sampling


def _batch(device, dtype, heads, seed=0):
    num_heads, num_kv_heads, head_dim = heads
    paged, _ = kernel_tests()[0].make_batch(CONTEXT_LENS, QUERY_LENS, num_heads, num_kv_heads, head_dim, 16, dtype,
                                            device=device, seed=seed)
    return paged, head_dim ** -0.5


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_splits", [1, 8, None], ids=["one-pass", "split-8", "heuristic"])
def test_paged_attention_at_serving_sizes(device, dtype, heads, num_kv_splits):
    paged, scale = _batch(device, dtype, heads)
    ref = pa.paged_attention_reference(*paged, scale)
    out = pa.paged_attention_triton(*paged, scale, max(QUERY_LENS), num_kv_splits=num_kv_splits)
    tol = kernel_tests()[0].TOLERANCE[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_replayed_from_a_cuda_graph(device, dtype):
    """Captured once, replayed on new queries and new cache contents in the same buffers
    (what the engine's decode graphs do): the replay computes the new inputs' attention."""
    if device != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    paged, scale = _batch(device, dtype, (14, 2, 64))
    q, k_cache, v_cache = (t.clone() for t in paged[:3])
    rest = paged[3:]

    def attend():
        return pa.paged_attention_triton(q, k_cache, v_cache, *rest, scale, max(QUERY_LENS))

    attend()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend()
    fresh, _ = _batch(device, dtype, (14, 2, 64), seed=1)
    for buffer, new in zip((q, k_cache, v_cache), fresh[:3]):
        buffer.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    expected = pa.paged_attention_reference(*fresh[:3], *rest, scale)
    tol = kernel_tests()[0].TOLERANCE[dtype]
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_reference(device, dtype):
    """Every new token's K/V lands in its slot bit for bit; padding rows (slot -1) write nothing."""
    num_blocks, num_tokens = 64, 300
    shape = (num_blocks, 16, 4, 128)
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(num_tokens, 4, 128, generator=gen).to(dtype).to(device) for _ in range(2))
    slots = torch.randperm(num_blocks * 16, generator=gen)[:num_tokens]
    slots[::7] = -1
    caches = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2)]
    ref = [c.clone() for c in caches]
    pa.write_kv_reference(k, v, *ref, slots.to(device))
    pa.write_kv_triton(k, v, *caches, slots.to(device))
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sampling_with_a_qwen_vocabulary(device, dtype):
    """151,936 logits per row, greedy and sampled, top-k / top-p / min-p mixed in one
    batch: the same tokens as the reference, logprobs within float32 rounding."""
    n = 64
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(n, 151_936, generator=gen) * 4).to(dtype).to(device)
    args = kernel_tests()[1].params(n, temperature=[0.0, 0.7, 1.0, 1.3] * (n // 4), top_k=[0, 0, 50, 0] * (n // 4),
                                    top_p=[0.0, 0.95, 0.0, 0.9] * (n // 4), min_p=[0.0, 0.0, 0.0, 0.05] * (n // 4))
    args = tuple(a.to(device) for a in args)
    ref_tokens, ref_lp = sp.sample_reference(logits, *args)
    tokens, lp = sp.sample_triton(logits, *args)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(lp, ref_lp, atol=1e-4, rtol=1e-4)
