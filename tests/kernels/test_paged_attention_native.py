"""The CPU paged attention's compiled passes (kernels/paged_attention_native.py) against
the PyTorch reference (``paged_attention_reference``).

If these fail, a CPU worker's decode and verify steps attend over other keys than the
reference's (a wrong block, a position past a sequence's context, another sequence's
rows), or a bad argument reaches memory instead of an error."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import paged_attention_native as native
from kernels.paged_attention import paged_attention, paged_attention_reference

ROOT = Path(__file__).resolve().parents[2]


def test_the_library_is_built():
    assert native.available(), f"{native.library_path()} does not load: run `make install`"


def batch(seed: int, num_seqs: int, num_kv_heads: int, group: int, head_dim: int, block_size: int,
          max_ctx: int, max_query: int, padding_rows: int = 0):
    """Random sequences over a shuffled block pool whose unused slots hold NaN: any read
    past a sequence's context, or of a block it does not own, shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, max_ctx + 1, (num_seqs,), generator=gen)
    qlen = torch.minimum(torch.randint(0, max_query + 1, (num_seqs,), generator=gen), ctx)
    blocks = [-(-int(c) // block_size) for c in ctx]
    width = max(blocks) + int(torch.randint(0, 3, (1,), generator=gen))
    num_blocks = sum(blocks) + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((num_seqs, width), num_blocks - 1, dtype=torch.int32)  # unused entries: any block
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = k_cache.clone()
    at = 0
    for s, (c, b) in enumerate(zip(ctx.tolist(), blocks)):
        tables[s, :b] = order[at:at + b].int()
        at += b
        for p in range(c):  # only the context's slots get values
            blk, off = int(tables[s, p // block_size]), p % block_size
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen)
    starts = torch.zeros(num_seqs + 1, dtype=torch.int32)
    starts[1:] = qlen.cumsum(0)
    q = torch.randn(int(starts[-1]) + padding_rows, num_kv_heads * group, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, ctx.int(), starts


def reference(q, k_cache, v_cache, tables, ctx, starts, scale):
    """The reference, on a cache whose NaN slots are zeroed (it reads padded slots and
    relies on them being finite only where they are masked)."""
    return paged_attention_reference(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), tables, ctx, starts, scale)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), num_seqs=st.integers(1, 6), num_kv_heads=st.integers(1, 3),
       group=st.integers(1, 3), head_dim=st.sampled_from([1, 4, 8, 13, 64]), block_size=st.sampled_from([1, 4, 16]),
       max_ctx=st.integers(1, 70), max_query=st.integers(0, 9), padding_rows=st.integers(0, 2))
def test_equals_the_reference(seed, num_seqs, num_kv_heads, group, head_dim, block_size, max_ctx, max_query,
                              padding_rows):
    """Decode and verify rows (queries of 0-9 rows), grouped KV heads, head sizes off the
    vector width, contexts over several blocks in any order, padding rows past the last
    query (left at 0)."""
    q, k_cache, v_cache, tables, ctx, starts = batch(seed, num_seqs, num_kv_heads, group, head_dim, block_size,
                                                     max_ctx, max_query, padding_rows)
    scale = head_dim ** -0.5
    got = native.paged_attention_native(q, k_cache, v_cache, tables, ctx, starts, scale, max_query_len=max_query)
    want = reference(q, k_cache, v_cache, tables, ctx, starts, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_row_is_independent_of_its_batch_and_the_thread_split():
    """A sequence's rows come out bit for bit the same alone, among others, and with the
    batch split across threads (a fixed summation order per row)."""
    q, k_cache, v_cache, tables, ctx, starts = batch(7, 12, 2, 3, 16, 4, 90, 5)
    scale = 0.25
    together = native.paged_attention_native(q, k_cache, v_cache, tables, ctx, starts, scale, num_threads=1)
    native.PARALLEL_MIN_WORK, saved = 1, native.PARALLEL_MIN_WORK
    try:
        split = native.paged_attention_native(q, k_cache, v_cache, tables, ctx, starts, scale, num_threads=3)
    finally:
        native.PARALLEL_MIN_WORK = saved
    assert torch.equal(together, split)
    for s in range(12):
        a, b = int(starts[s]), int(starts[s + 1])
        alone = native.paged_attention_native(q[a:b], k_cache, v_cache, tables[s:s + 1], ctx[s:s + 1],
                                              starts[s:s + 2] - a, scale, num_threads=1)
        assert torch.equal(alone, together[a:b]), s


def test_the_dispatcher_runs_it_on_the_cpu_and_the_reference_elsewhere(monkeypatch):
    """Decode and verify steps take the compiled passes; a prefill-length query, a tree
    mask or float64 tensors take the reference."""
    q, k_cache, v_cache, tables, ctx, starts = batch(3, 4, 1, 2, 8, 4, 40, 3)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)
    calls = []
    real = native.paged_attention_native

    def counted(*args, **kw):
        out = real(*args, **kw)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("kernels.paged_attention.paged_attention_native", counted)
    args = (q, k_cache, v_cache, tables, ctx, starts, 0.3)
    torch.testing.assert_close(paged_attention(*args, max_query_len=3), paged_attention_reference(*args))
    paged_attention(*args, max_query_len=native.MAX_QUERY + 1)
    paged_attention(*args, tree_mask=torch.full((q.shape[0],), -1, dtype=torch.int64))
    paged_attention(q.double(), k_cache.double(), v_cache.double(), *args[3:])
    assert calls == [True, False, False, False]


@pytest.mark.parametrize("break_it, bad_seq", [
    (lambda t, c, s: t.__setitem__((1, 0), 10_000), 1),  # a block past the pool
    (lambda t, c, s: t.__setitem__((1, 0), -1), 1),
    (lambda t, c, s: c.__setitem__(2, 10_000), 2),  # a context past the sequence's table
    (lambda t, c, s: s.__setitem__(3, 10_000), 2),  # rows past q
    (lambda t, c, s: s.__setitem__(1, -5), 0),  # a negative query length
    (lambda t, c, s: c.__setitem__(0, 0), 0),  # a query longer than its context
])
def test_hostile_arguments_raise_naming_the_sequence(break_it, bad_seq):
    """Out-of-range blocks, lengths and query starts: a ValueError naming the sequence and
    the fields, checked before the passes read anything (the sanitized build below runs
    this too: no read or write out of bounds)."""
    q, k_cache, v_cache, tables, ctx, starts = batch(5, 4, 1, 1, 8, 4, 30, 2)
    starts = torch.tensor([0, 2, 4, 6, 8], dtype=torch.int32)
    q = torch.randn(8, 1, 8)
    ctx = torch.maximum(ctx, torch.tensor(2)).int()
    tables = torch.cat([tables, torch.zeros(4, 8, dtype=torch.int32)], dim=1)
    break_it(tables, ctx, starts)
    with pytest.raises(ValueError, match=f"sequence {bad_seq}'s seq_lens, query_start_loc or block_tables are out"):
        native.paged_attention_native(q, k_cache, v_cache, tables, ctx, starts, 0.5, max_query_len=2)


def test_mismatched_shapes_raise():
    q, k_cache, v_cache, tables, ctx, starts = batch(1, 2, 2, 1, 8, 4, 10, 1)
    with pytest.raises(ValueError, match="must cover"):  # fewer table rows than sequences
        native.paged_attention_native(q, k_cache, v_cache, tables[:1], ctx, starts, 0.5)
    with pytest.raises(ValueError, match="must cover"):  # fewer query starts than sequences + 1
        native.paged_attention_native(q, k_cache, v_cache, tables, ctx, starts[:2], 0.5)
    with pytest.raises(ValueError, match="must be"):
        native.paged_attention_native(q[:, 0], k_cache, v_cache, tables, ctx, starts, 0.5)
    with pytest.raises(ValueError, match="do not fit"):
        native.paged_attention_native(q[:, :, :4], k_cache, v_cache, tables, ctx, starts, 0.5)
    with pytest.raises(ValueError, match="do not fit"):
        native.paged_attention_native(q, k_cache, v_cache[:, :, :1], tables, ctx, starts, 0.5)


def _asan_runtime() -> str | None:
    path = subprocess.run([os.environ.get("CXX", "g++"), "-print-file-name=libasan.so"], capture_output=True,
                          text=True, check=False).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.slow  # the sanitized build, then the tests above in a subprocess
@pytest.mark.skipif(_asan_runtime() is None, reason="no AddressSanitizer runtime for the C++ compiler")
@pytest.mark.skipif(torch.version.cuda is not None,
                    reason="the CUDA build of torch: the subprocess with ASan's runtime preloaded aborted at "
                           "start with no output on the H100 image (torch 2.11+cu130, g++ 13, 2026-11-26); "
                           "these passes are CPU code, checked where torch is the CPU build (make test, CI)")
def test_sanitized_build_runs_these_tests_clean(tmp_path):
    """The passes built with -fsanitize=address,undefined (any finding aborts) run the
    reference comparison and the hostile arguments."""
    sys.path.insert(0, str(ROOT / "services" / "rollout" / "drafter" / "native"))
    try:
        import build
    finally:
        sys.path.pop(0)
    lib = build.build(sanitize=True, target="attention", out=tmp_path / "libattention_asan.so")
    env = dict(os.environ, LD_PRELOAD=_asan_runtime(), ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", RHYMERL_ATTENTION_LIBRARY=str(lib),
               PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                           "equals_the_reference or hostile or independent", __file__],
                          env=env, capture_output=True, text=True, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
