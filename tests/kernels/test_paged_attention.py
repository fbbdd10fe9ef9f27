"""paged attention and write_kv: Triton == reference == dense SDPA per sequence.

If these fail, the engine's decode/verify/prefill logits are wrong (and speculative
decoding stops being lossless, because verify and decode would disagree)."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import paged_attention as pa

# The Triton path runs on the GPU when there is one, else in Triton's interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-3, torch.bfloat16: 3e-2}


def make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
               device="cpu", seed=0):
    """A ragged batch with its dense K/V and a shuffled (non-contiguous) block pool.

    Returns q, dense per-sequence (k, v), and the paged inputs; the cache is filled
    through write_kv_reference, padding slots included, as the engine does."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    max_blocks = max(blocks_per_seq) + 1  # a spare column: tables are wider than needed
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold garbage nobody may read
    pool = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for s, n in enumerate(blocks_per_seq):
        block_tables[s, :n] = pool[used:used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # garbage outside the contexts
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    dense = []
    for s, c in enumerate(context_lens):
        k = torch.randn(c, num_kv_heads, head_dim, generator=gen).to(dtype)  # [ctx, kvh, d]
        v = torch.randn(c, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(c)
        slots = block_tables[s, pos // block_size].long() * block_size + pos % block_size  # [ctx]
        junk = torch.ones(2, num_kv_heads, head_dim, dtype=dtype)  # padding rows, slot -1
        pad = torch.full((2,), -1, dtype=torch.int64)
        pa.write_kv_reference(torch.cat([k, junk]), torch.cat([v, junk]), k_cache, v_cache,
                              torch.cat([slots, pad]))
        dense.append((k, v))
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    cu = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    paged = tuple(t.to(device) for t in (q, k_cache, v_cache, block_tables, seq_lens, cu))
    return paged, dense


def dense_sdpa(q, dense, query_lens, scale):
    """Causal attention per sequence with torch SDPA on contiguous K/V."""
    num_heads = q.shape[1]
    out, start = [], 0
    for (k, v), query_len in zip(dense, query_lens):
        context_len, num_kv_heads = k.shape[:2]
        group = num_heads // num_kv_heads
        qs = q[start:start + query_len].float().transpose(0, 1)  # [h, qlen, d]
        ks = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [h, ctx, d]
        vs = v.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [h, ctx, d]
        q_pos = torch.arange(query_len) + context_len - query_len  # [qlen]
        visible = torch.arange(context_len)[None, :] <= q_pos[:, None]  # [qlen, ctx]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale)  # [h, qlen, d]
        out.append(o.transpose(0, 1))
        start += query_len
    return torch.cat(out).to(q.dtype)


SCENARIOS = {
    # name: (context_lens, query_lens, num_heads, num_kv_heads, head_dim)
    "decode": ([37, 1, 16, 70], [1, 1, 1, 1], 4, 4, 32),
    "decode_gqa": ([45, 3, 130], [1, 1, 1], 8, 2, 32),
    "verify_ragged_drafts": ([20, 41, 9], [4, 1, 7], 4, 2, 32),
    "chunked_prefill": ([48, 33], [32, 33], 2, 1, 16),
    "mixed_with_empty_seq": ([30, 12, 64], [1, 0, 17], 6, 3, 64),
    "odd_head_dim": ([19, 40], [3, 5], 2, 2, 24),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_triton_matches_reference_and_sdpa(name, dtype):
    """Decode, ragged verify, chunked prefill and GQA agree across all three paths."""
    context_lens, query_lens, num_heads, num_kv_heads, head_dim = SCENARIOS[name]
    paged, dense = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim,
                              block_size=16, dtype=dtype, device=DEVICE)
    scale = head_dim ** -0.5
    ref = pa.paged_attention_reference(*paged, scale)
    expected = dense_sdpa(paged[0].cpu(), dense, query_lens, scale)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ref.cpu(), expected, atol=tol, rtol=tol)
    out = pa.paged_attention_triton(*paged, scale, max_query_len=max(query_lens))
    assert out.dtype == dtype and out.shape == paged[0].shape
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", SCENARIOS)
def test_split_kv_matches_single_pass(name):
    """Flash-decoding (context split across programs, partials merged) changes nothing,
    including splits that hold no visible key for some rows."""
    context_lens, query_lens, num_heads, num_kv_heads, head_dim = SCENARIOS[name]
    paged, _ = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim,
                          block_size=16, dtype=torch.float32, device=DEVICE, seed=1)
    scale = head_dim ** -0.5
    single = pa.paged_attention_triton(*paged, scale, max(query_lens), num_kv_splits=1)
    split = pa.paged_attention_triton(*paged, scale, max(query_lens), num_kv_splits=3)
    torch.testing.assert_close(split, single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_padding_rows_past_the_last_sequence_are_zero(num_kv_splits, monkeypatch):
    """CUDA-graph padding: q rows that no sequence owns come out as 0, never garbage."""
    paged, _ = make_batch([20, 9], [2, 3], 2, 1, 16, 16, torch.float32, device=DEVICE)
    q = torch.cat([paged[0], torch.full_like(paged[0][:3], 7.0)])  # 3 padding rows
    empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t: empty_like(t).fill_(float("nan")))  # visible garbage
    out = pa.paged_attention_triton(q, *paged[1:], 0.25, 3, num_kv_splits=num_kv_splits)
    ref = pa.paged_attention_reference(q, *paged[1:], 0.25)
    assert torch.equal(out[5:].cpu(), torch.zeros(3, 2, 16)) and torch.equal(ref[5:], torch.zeros_like(ref[5:]))
    torch.testing.assert_close(out[:5], ref[:5], atol=2e-3, rtol=2e-3)


def test_max_query_len_is_optional():
    """Callers that do not know max_query_len get the same result (one device sync)."""
    paged, _ = make_batch([25, 18], [3, 6], 4, 2, 16, 16, torch.float32, device=DEVICE)
    a = pa.paged_attention_triton(*paged, 0.25)
    b = pa.paged_attention_triton(*paged, 0.25, max_query_len=6)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_reference_matches_sdpa_on_random_ragged_batches(data):
    """The ground truth itself: any block size, GQA ratio and ragged query split."""
    num_seqs = data.draw(st.integers(1, 4))
    context_lens = data.draw(st.lists(st.integers(1, 50), min_size=num_seqs, max_size=num_seqs))
    query_lens = [data.draw(st.integers(0, c)) for c in context_lens]
    num_kv_heads = data.draw(st.sampled_from([1, 2]))
    num_heads = num_kv_heads * data.draw(st.sampled_from([1, 3]))
    block_size = data.draw(st.sampled_from([1, 4, 16]))
    paged, dense = make_batch(context_lens, query_lens, num_heads, num_kv_heads, 8, block_size,
                              torch.float32, seed=data.draw(st.integers(0, 1000)))
    out = pa.paged_attention_reference(*paged, 0.3)
    torch.testing.assert_close(out, dense_sdpa(paged[0], dense, query_lens, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_write_kv_stores_at_slots_and_skips_padding(dtype):
    """Every token lands at block_id * block_size + offset; slot -1 writes nothing."""
    num_blocks, block_size, num_kv_heads, head_dim = 5, 16, 2, 8
    k = torch.randn(6, num_kv_heads, head_dim).to(dtype)  # [num_tokens, kvh, d]
    v = torch.randn(6, num_kv_heads, head_dim).to(dtype)
    slots = torch.tensor([3 * 16 + 2, -1, 0, 4 * 16 + 15, -1, 17])  # [num_tokens]
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    pa.write_kv_reference(k, v, k_cache, v_cache, slots)
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // block_size, slot % block_size], k[token])
            assert torch.equal(v_cache[slot // block_size, slot % block_size], v[token])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 4  # only the four real slots
    k_tri = torch.zeros_like(k_cache, device=DEVICE)
    v_tri = torch.zeros_like(v_cache, device=DEVICE)
    pa.write_kv_triton(k.to(DEVICE), v.to(DEVICE), k_tri, v_tri, slots.to(DEVICE))
    assert torch.equal(k_tri.cpu(), k_cache) and torch.equal(v_tri.cpu(), v_cache)


def test_dispatcher_uses_reference_on_cpu_by_default(monkeypatch):
    """CPU callers (engine tests) get the fast reference unless they opt in."""
    monkeypatch.delenv("RHYMERL_TRITON", raising=False)
    assert not pa.use_triton(torch.zeros(1))
    monkeypatch.setenv("RHYMERL_TRITON", "1")
    assert pa.use_triton(torch.zeros(1)) == (pa.triton is not None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_gpu_realistic_shapes(dtype):
    """Qwen2.5-like heads (14 q / 2 kv, head_dim 64) and 128-dim heads, long contexts."""
    for num_heads, num_kv_heads, head_dim in ((14, 2, 64), (32, 8, 128)):
        context_lens = [2048, 513, 1, 900, 1500, 77]
        query_lens = [1, 9, 1, 5, 300, 77]
        paged, _ = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim, 16, dtype,
                              device="cuda")
        scale = head_dim ** -0.5
        ref = pa.paged_attention_reference(*paged, scale)
        out = pa.paged_attention(*paged, scale, max_query_len=300)
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
