"""The CPU sampler's compiled RNG (kernels/gumbel_native.py) against the PyTorch
reference (``sampling.gumbel_noise``), bit for bit.

If these fail, a CPU worker samples other tokens than the reference (and than a GPU
worker's Triton kernel): speculation would stay lossless, but a rollout would no longer
be reproducible across workers built with and without `make install`."""

import logging
import subprocess
import sys

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
