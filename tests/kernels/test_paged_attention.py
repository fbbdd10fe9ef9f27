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


# ------------------------------------------------------------------ batch-invariant mode

INVARIANT_PATHS = {
    "reference": lambda *args: pa.paged_attention(*args, batch_invariant=True),
    "triton": lambda *args: pa.paged_attention_triton(*args, batch_invariant=True),
}


@pytest.fixture
def small_kv_splits(monkeypatch):
    """64 key positions per split, so that contexts of a few hundred tokens use several."""
    monkeypatch.setattr(pa, "KV_SPLIT_TOKENS", 64)


@pytest.mark.parametrize("path", INVARIANT_PATHS)
@pytest.mark.parametrize("name", SCENARIOS)
def test_batch_invariant_paths_match_sdpa(name, path, small_kv_splits):
    """Batch-invariant mode computes the same attention (to rounding) as dense SDPA."""
    context_lens, query_lens, num_heads, num_kv_heads, head_dim = SCENARIOS[name]
    paged, dense = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_dim,
                              block_size=16, dtype=torch.float32, device=DEVICE if path == "triton" else "cpu")
    scale = head_dim ** -0.5
    out = INVARIANT_PATHS[path](*paged, scale, max(query_lens))
    torch.testing.assert_close(out.cpu(), dense_sdpa(paged[0].cpu(), dense, query_lens, scale), atol=1e-5, rtol=1e-5)


def invariance_universe(context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """A KV cache holding every sequence's whole context, and a query vector for every
    position of every sequence, from which batches of any composition are cut."""
    paged, _ = make_batch(context_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                          seed=seed)
    q_all, k_cache, v_cache, block_tables = paged[:4]
    starts = [0] + torch.tensor(context_lens).cumsum(0).tolist()
    return [q_all[a:b] for a, b in zip(starts, starts[1:])], k_cache, v_cache, block_tables


def run_case(path, universe, items, extra_columns=0):
    """items: (sequence, query_len, context_len): its query rows are the last query_len
    positions of a context of context_len. Returns each item's output rows."""
    qs, k_cache, v_cache, tables = universe
    q = torch.cat([qs[s][c - n:c] for s, n, c in items])
    cu = torch.tensor([0] + [n for _, n, _ in items]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([c for _, _, c in items], dtype=torch.int32)
    block_tables = torch.cat([tables[[s for s, _, _ in items]],
                              torch.zeros(len(items), extra_columns, dtype=torch.int32)], dim=1)
    args = [t.to(DEVICE if path == "triton" else "cpu") for t in (q, k_cache, v_cache, block_tables, seq_lens, cu)]
    out = INVARIANT_PATHS[path](*args, 0.25, max(n for _, n, _ in items)).cpu()
    return [out[a:b] for a, b in zip(cu.tolist(), cu[1:].tolist())]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("path", INVARIANT_PATHS)
def test_batch_invariant_row_does_not_depend_on_its_batch(path, dtype, small_kv_splits):
    """A probe's query row at a position comes out bit for bit the same as a decode alone,
    as the last row of a verify, inside a prefill chunk, beside other sequences, with
    wider block tables (more splits launched) and at shorter contexts (a chunk boundary)."""
    universe = invariance_universe([150, 70, 3, 130], 4, 2, 16, 16, dtype)
    probe = 0

    def rows(items, extra_columns=0):
        out = run_case(path, universe, items, extra_columns)
        return out[[s for s, _, _ in items].index(probe)]

    alone = {c: rows([(probe, 1, c)])[0] for c in (150, 100, 65, 64, 1)}  # decode at position c - 1
    cases = [
        ([(1, 1, 70), (probe, 1, 150), (2, 1, 3), (3, 1, 130)], 0),  # decode in a batch
        ([(probe, 7, 150)], 0),  # verify of 6 drafts
        ([(3, 9, 130), (probe, 17, 150), (1, 40, 70)], 0),  # ragged verify beside a prefill chunk
        ([(probe, 150, 150)], 0),  # the whole sequence as one prefill
        ([(probe, 1, 150), (2, 3, 3)], 5),  # wider block tables: more (empty) splits
    ]
    for items, extra in cases:
        out = rows(items, extra)
        n = dict((s, n) for s, n, _ in items)[probe]
        assert torch.equal(out[-1], alone[150]), items
        for c in (100, 65, 64, 1):  # earlier positions of the probe inside this case's rows
            if 150 - n < c:
                assert torch.equal(out[c - 1 - (150 - n)], alone[c]), (items, c)
