"""The CPU sampler's compiled RNG (kernels/gumbel_native.py) against the PyTorch
reference (``sampling.gumbel_noise``), bit for bit.

If these fail, a CPU worker samples other tokens than the reference (and than a GPU
worker's Triton kernel): speculation would stay lossless, but a rollout would no longer
be reproducible across workers built with and without `make install`."""

import logging
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import gumbel_native
from kernels import sampling as sp

INT64 = st.integers(-2**63, 2**63 - 1)


def test_the_library_is_built():
    assert gumbel_native.available(), f"{gumbel_native.library_path()} does not load: run `make install`"


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)  # NaN-safe, -0.0 != 0.0: equal bits, not equal values


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(INT64, INT64), min_size=0, max_size=9),
       vocab=st.integers(1, 3000), block_elements=st.integers(1, 8192))
def test_noise_is_the_reference_bit_for_bit(rows, vocab, block_elements):
    """Any seeds and positions (negative, past 2**32), any vocabulary (vector tails), any
    block split."""
    seeds = torch.tensor([s for s, _ in rows], dtype=torch.int64)
    positions = torch.tensor([p for _, p in rows], dtype=torch.int64)
    got = gumbel_native.gumbel_noise(seeds, positions, vocab, block_elements=block_elements)
    assert torch.equal(_bits(got), _bits(sp.gumbel_noise(seeds, positions, vocab)))


def test_noise_at_a_real_vocabulary_is_the_reference():
    """SmolLM2's 49,152 and Qwen's 151,936 tokens: hi >= 2**31 half the time, both
    branches and the extremes of U within a row."""
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, 123456789], dtype=torch.int64)
    positions = torch.tensor([0, 511, 2**33 + 7, 5, -3], dtype=torch.int64)
    for vocab in (49152, 151936):
        got = gumbel_native.gumbel_noise(seeds, positions, vocab)
        ref = sp.gumbel_noise(seeds, positions, vocab)
        assert torch.equal(_bits(got), _bits(ref))
        assert torch.isfinite(got).all()


def test_cpu_sample_uses_it_and_samples_the_reference_tokens(monkeypatch):
    """``sample`` on the CPU (the worker's path) gives the reference's tokens and logprobs
    under every truncation, and takes its noise from the compiled RNG."""
    gen = torch.Generator().manual_seed(3)
    n, vocab = 12, 2053
    logits = torch.randn(n, vocab, generator=gen) * 4
    args = (torch.tensor([1.0, 0.7, 0.0, 1.3] * 3), torch.tensor([0, 5, 0, 0] * 3, dtype=torch.int32),
            torch.tensor([0.0, 0.0, 0.9, 0.5] * 3), torch.tensor([0.0, 0.0, 0.0, 0.05] * 3),
            torch.arange(n, dtype=torch.int64) * 7919 - 5, torch.arange(n, dtype=torch.int64) + 2**32)
    calls = []
    real = gumbel_native.gumbel_noise
    monkeypatch.setattr(gumbel_native, "gumbel_noise", lambda *a, **k: calls.append(a) or real(*a, **k))
    tokens, logprobs = sp.sample(logits, *args)
    ref_tokens, ref_logprobs = sp.sample_reference(logits, *args)
    assert calls, "the CPU sampler did not use the compiled RNG"
    assert torch.equal(tokens, ref_tokens) and torch.equal(_bits(logprobs), _bits(ref_logprobs))


def test_without_the_library_the_sampler_runs_the_reference_and_says_so(tmp_path, caplog):
    missing = tmp_path / "libgumbel.so"
    with caplog.at_level(logging.WARNING, logger="kernels.gumbel_native"):
        assert gumbel_native.load_library(missing) is None
    assert "make install" in caplog.text and str(missing) in caplog.text
    (tmp_path / "broken.so").write_bytes(b"not a library")
    assert gumbel_native.load_library(tmp_path / "broken.so") is None
    # a whole process without it: the same tokens as the reference
    code = ("import torch; from kernels import sampling as sp, gumbel_native as g;"
            "assert not g.available();"
            "l = torch.randn(3, 500, generator=torch.Generator().manual_seed(1));"
            "a = (torch.ones(3), torch.zeros(3, dtype=torch.int32), torch.zeros(3), torch.zeros(3),"
            " torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]));"
            "t, _ = sp.sample(l, *a); r, _ = sp.sample_reference(l, *a); assert torch.equal(t, r); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, gumbel_native.LIBRARY_ENV: str(missing)})
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
    assert "make install" in out.stderr


# ---------------------------------------------------------------------- screened Gumbel-max


def test_the_bounds_table_holds_every_units_noise():
    """For a million random units of each branch, and the extremes (the smallest unit, 1/2,
    and each bucket's ends), the reference's noise lies within its bucket's bounds: the
    screening drops a token only if its score cannot be the best."""
    gen = torch.Generator().manual_seed(0)
    hi = torch.randint(0, 2**32, (1 << 20,), generator=gen, dtype=torch.int64)
    lo = torch.randint(0, 2**32, (1 << 20,), generator=gen, dtype=torch.int64)
    units = torch.where(hi < 2**31, sp._unit(hi, lo), -sp._unit(hi ^ 0xFFFFFFFF, lo ^ 0xFFFFFFFF))
    edges = torch.arange(gumbel_native.NUM_BUCKETS, dtype=torch.int64) << gumbel_native.BUCKET_SHIFT
    edge_units = torch.cat([edges, edges + (1 << gumbel_native.BUCKET_SHIFT) - 1]).clamp(1, 0x3F000000)
    edge_units = edge_units.to(torch.int32).view(torch.float32)
    edge_units = edge_units[edge_units >= sp._unit(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))]
    units = torch.cat([units, edge_units, -edge_units])
    noise = gumbel_native._noise_of_units(units)
    bucket = units.abs().view(torch.int32).long() >> gumbel_native.BUCKET_SHIFT
    table = gumbel_native.bounds_table()[(units < 0).long(), bucket]  # [units, 2]
    assert (table[:, 0] <= noise).all() and (noise <= table[:, 1]).all()


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.tuples(INT64, INT64), min_size=1, max_size=6), vocab=st.integers(1, 2500),
       scale=st.sampled_from([0.0, 0.01, 1.0, 8.0, 50.0]), rounding=st.booleans(), masked=st.booleans())
def test_screened_tokens_are_the_full_argmax(rows, vocab, scale, rounding, masked):
    """Any seeds and positions, vocabularies, logit scales (0: every token ties, past the
    candidate cap: the full path), exact ties (rounded logits), -inf tokens."""
    n = len(rows)
    seeds = torch.tensor([s for s, _ in rows], dtype=torch.int64)
    positions = torch.tensor([p for _, p in rows], dtype=torch.int64)
    scaled = torch.randn(n, vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    if rounding:
        scaled = torch.round(scaled)
    if masked:
        scaled[:, ::3] = float("-inf")
    want = (scaled + sp.gumbel_noise(seeds, positions, vocab)).argmax(dim=1)
    assert torch.equal(gumbel_native.sample_screened(scaled, seeds, positions), want)


def test_screened_tokens_at_a_real_vocabulary_and_across_threads(monkeypatch):
    """SmolLM2's vocabulary, 64 rows split across threads: the reference's tokens, and few
    rows sampled in full."""
    n, vocab = 64, 49152
    scaled = torch.randn(n, vocab, generator=torch.Generator().manual_seed(5)) * 3
    seeds, positions = torch.arange(n, dtype=torch.int64) * 7919 + 11, torch.arange(n, dtype=torch.int64) + 300
    want = (scaled + sp.gumbel_noise(seeds, positions, vocab)).argmax(dim=1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert torch.equal(gumbel_native.sample_screened(scaled, seeds, positions), want)


def test_cpu_sample_screens_untruncated_rows_and_matches_the_reference(monkeypatch):
    """A step without truncation takes the screened path (no full noise), greedy rows
    their argmax; tokens and logprobs are the reference's bit for bit."""
    gen = torch.Generator().manual_seed(11)
    n, vocab = 9, 3001
    logits = torch.randn(n, vocab, generator=gen) * 5
    args = (torch.tensor([1.0, 0.0, 0.7] * 3), torch.zeros(n, dtype=torch.int32), torch.zeros(n), torch.zeros(n),
            torch.arange(n, dtype=torch.int64) - 4, torch.arange(n, dtype=torch.int64) * 3)
    monkeypatch.setattr(gumbel_native, "gumbel_noise", lambda *a, **k: pytest.fail("the full noise was computed"))
    tokens, logprobs = sp.sample(logits, *args, truncation=(False, False))
    monkeypatch.undo()
    ref_tokens, ref_logprobs = sp.sample_reference(logits, *args)
    assert torch.equal(tokens, ref_tokens) and torch.equal(_bits(logprobs), _bits(ref_logprobs))


def test_screened_tokens_resolve_near_ties_and_exact_ties():
    """Rows whose runner-up is moved to within a bucket's width of the best (above or
    below it, by up to 0.02) or onto it exactly: the candidates must hold both, and the
    exact noise decide (an exact tie: the lower id, as argmax)."""
    n, vocab = 240, 1000
    gen = torch.Generator().manual_seed(9)
    scaled = torch.randn(n, vocab, generator=gen) * 3
    seeds, positions = torch.arange(n, dtype=torch.int64) * 31 + 7, torch.arange(n, dtype=torch.int64)
    noise = sp.gumbel_noise(seeds, positions, vocab)
    top2 = (scaled + noise).topk(2, dim=1).indices  # [n, 2]
    rows = torch.arange(n)
    best, second = top2[:, 0], top2[:, 1]
    gap = torch.linspace(-0.02, 0.02, n)
    gap[::8] = 0.0  # exact ties, where the float sums allow
    target = (scaled + noise)[rows, best] + gap
    scaled[rows, second] = target - noise[rows, second]
    want = (scaled + noise).argmax(dim=1)
    assert (want == second).sum() > n // 4 and (want == best).sum() > n // 4  # both sides of the tie happen
    assert torch.equal(gumbel_native.sample_screened(scaled, seeds, positions), want)
