"""Gumbel-max sampling: greedy, reproducibility, truncation, distribution, Triton == reference.

If these fail, speculative decoding is no longer lossless (a draft is accepted exactly
when it equals the sampled token, so the sample must be a pure function of the row) or
the trainer's logprobs disagree with the policy's."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import sampling as sp

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton: GPU, else the interpreter


def params(n, temperature=1.0, top_k=0, top_p=0.0, min_p=0.0, seed0=1234, position0=0):
    """Per-row sampling parameters: scalars are broadcast, lists are taken as is."""
    def col(x, dtype):
        return torch.tensor(x if isinstance(x, list) else [x] * n, dtype=dtype)
    seeds = torch.arange(n, dtype=torch.int64) * 7919 + seed0  # [n]
    positions = torch.arange(n, dtype=torch.int64) + position0  # [n]
    return (col(temperature, torch.float32), col(top_k, torch.int32), col(top_p, torch.float32),
            col(min_p, torch.float32), seeds, positions)


def both(logits, args):
    """(reference, triton) results; the Triton one computed on DEVICE."""
    ref = sp.sample_reference(logits, *args)
    tri = sp.sample_triton(logits.to(DEVICE), *(a.to(DEVICE) for a in args))
    return ref, tuple(t.cpu() for t in tri)


def test_greedy_is_argmax_with_ties_to_lowest_id():
    """T == 0 returns the argmax, the lowest id among equal maxima, even across vocab blocks."""
    logits = torch.randn(3, 5000)
    logits[0, [10, 4000]] = 50.0  # tie spanning two Triton vocab blocks
    logits[1, [2047, 2048]] = 50.0  # tie across the block boundary
    args = params(3, temperature=0.0, top_k=[0, 5, 0], top_p=[0.0, 0.5, 0.0], min_p=[0.0, 0.0, 0.3])
    (ref_tokens, ref_lp), (tri_tokens, tri_lp) = both(logits, args)
    expected = torch.tensor([10, 2047, int(logits[2].argmax())])
    assert torch.equal(ref_tokens, expected) and torch.equal(tri_tokens, expected)
    expected_lp = torch.log_softmax(logits, -1).gather(1, expected[:, None]).squeeze(1)  # T' = 1
    torch.testing.assert_close(ref_lp, expected_lp)
    torch.testing.assert_close(tri_lp, expected_lp)


def test_token_is_independent_of_batch_order_and_size():
    """A row's token depends only on its logits, params, seed and position."""
    n = 8
    logits = torch.randn(n, 700)
    args = params(n, temperature=[0.5, 1.0, 1.5, 1.0, 0.8, 1.0, 1.2, 0.0], top_k=[0, 20, 0, 0, 5, 0, 0, 0],
                  top_p=[0.0, 0.0, 0.9, 0.0, 0.7, 0.0, 0.0, 0.0], min_p=[0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.2, 0.0])
    for sample in (sp.sample_reference, sp.sample_triton):
        full, _ = sample(logits.to(DEVICE), *(a.to(DEVICE) for a in args))
        perm = torch.randperm(n)
        shuffled, _ = sample(logits[perm].to(DEVICE), *(a[perm].to(DEVICE) for a in args))
        assert torch.equal(shuffled.cpu(), full.cpu()[perm])
        for i in (0, 3, 6):
            alone, _ = sample(logits[i:i + 1].to(DEVICE), *(a[i:i + 1].to(DEVICE) for a in args))
            assert int(alone) == int(full[i])


def test_different_seeds_and_positions_give_different_samples():
    """Over a flat distribution, 64 seeds (or 64 positions) must not collapse to a few tokens."""
    logits = torch.zeros(64, 1000)
    by_seed, _ = sp.sample_reference(logits, *params(64))
    seeds = torch.full((64,), 99, dtype=torch.int64)
    by_position, _ = sp.sample_reference(logits, *params(64)[:4], seeds, torch.arange(64, dtype=torch.int64))
    assert len(set(by_seed.tolist())) > 50 and len(set(by_position.tolist())) > 50
    noise = sp.gumbel_noise(torch.tensor([1, 2, 1]), torch.tensor([5, 5, 6]), 100)  # [3, 100]
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_triton_tokens_equal_reference(dtype):
    """Same hash, same Gumbel-max: identical tokens on tie-free random logits, all params mixed."""
    n = 24
    logits = (torch.randn(n, 3000) * 3).to(dtype)
    gen = torch.Generator().manual_seed(5)
    temperature = torch.rand(n, generator=gen) * 1.5 + 0.1
    temperature[::7] = 0.0
    args = params(n, temperature=temperature.tolist(),
                  top_k=torch.randint(0, 100, (n,), generator=gen).tolist(),
                  top_p=(torch.rand(n, generator=gen) * (torch.rand(n, generator=gen) < 0.5)).tolist(),
                  min_p=(torch.rand(n, generator=gen) * 0.2 * (torch.rand(n, generator=gen) < 0.5)).tolist(),
                  seed0=-(2 ** 40), position0=2 ** 33 - 10)
    (ref_tokens, ref_lp), (tri_tokens, tri_lp) = both(logits, args)
    assert torch.equal(tri_tokens, ref_tokens)
    torch.testing.assert_close(tri_lp, ref_lp, atol=1e-4, rtol=1e-5)


def test_minus_inf_logits_are_never_sampled():
    """Callers mask tokens with -inf (stop tokens before min_tokens), even whole vocab blocks."""
    n = 4
    logits = torch.randn(n, 2500)
    logits[:, :2100] = float("-inf")  # more than one Triton vocab block
    logits[1, 2200:] = float("-inf")
    args = params(n, temperature=[1.0, 0.0, 0.7, 1.0], top_p=[0.0, 0.0, 0.9, 0.0], min_p=[0.0, 0.0, 0.0, 0.1])
    for tokens, logprobs in both(logits, args):
        assert bool((tokens >= 2100).all()) and bool((tokens[1] < 2200).all())
        assert bool(torch.isfinite(logprobs).all())
    (ref_tokens, ref_lp), (tri_tokens, tri_lp) = both(logits, args)
    assert torch.equal(ref_tokens, tri_tokens)
    torch.testing.assert_close(tri_lp, ref_lp, atol=1e-5, rtol=1e-5)


def test_logprobs_are_untruncated_log_softmax():
    """Raw logprobs are log_softmax(logits / T)[token] over the whole vocabulary, truncation ignored."""
    n = 6
    logits = torch.randn(n, 400, dtype=torch.float64).float()
    args = params(n, temperature=[0.7, 1.0, 1.3, 0.0, 2.0, 1.0], top_k=[3, 0, 0, 0, 0, 1],
                  top_p=[0.0, 0.5, 0.0, 0.0, 0.0, 0.0], min_p=[0.0, 0.0, 0.3, 0.0, 0.0, 0.0])
    t_eff = torch.where(args[0] == 0, 1.0, args[0])  # [n]
    for tokens, logprobs in both(logits, args):
        expected = torch.log_softmax(logits.double() / t_eff[:, None].double(), -1)  # [n, vocab]
        torch.testing.assert_close(logprobs.double(), expected.gather(1, tokens[:, None]).squeeze(1),
                                   atol=1e-5, rtol=1e-5)


def brute_force_allowed(logits_row, temperature, top_k, top_p, min_p, margin=1e-4):
    """(surely allowed, surely truncated) id sets in float64, leaving out ids within
    `margin` of a top-p or min-p boundary, where float32 rounding may decide either way."""
    scaled = np.asarray(logits_row, dtype=np.float64) / (temperature or 1.0)
    order = sorted(range(len(scaled)), key=lambda v: (-scaled[v], v))
    kept = order[:top_k] if 0 < top_k < len(order) else order
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    allowed, truncated = set(), set(order) - set(kept)
    mass_before = 0.0
    for v, p in zip(kept, probs):
        ratio = p / probs[0]
        p_in = not (0 < top_p < 1) or mass_before < top_p - margin
        p_out = 0 < top_p < 1 and mass_before > top_p + margin
        m_in, m_out = ratio >= min_p + margin or min_p == 0, ratio < min_p - margin
        if p_in and m_in:
            allowed.add(v)
        elif p_out or m_out:
            truncated.add(v)
        mass_before += p
    return allowed, truncated


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_truncation_mask_matches_brute_force(data):
    """top_k, then top_p on the renormalised top-k, then min_p: the mask equals a float64 brute force."""
    vocab = data.draw(st.integers(2, 30))
    logits = data.draw(st.lists(st.floats(-5, 5), min_size=vocab, max_size=vocab))
    temperature = data.draw(st.sampled_from([0.5, 1.0, 2.0]))
    top_k = data.draw(st.integers(0, vocab + 2))
    top_p = data.draw(st.sampled_from([0.0, 0.3, 0.8, 0.95, 1.0]))
    min_p = data.draw(st.sampled_from([0.0, 0.05, 0.5]))
    scaled = torch.tensor([logits], dtype=torch.float32) / temperature
    mask = sp.allowed_mask(scaled, torch.ones(1), torch.tensor([top_k], dtype=torch.int32),
                           torch.tensor([top_p]), torch.tensor([min_p]))
    mask = torch.ones_like(scaled, dtype=torch.bool) if mask is None else mask
    allowed, truncated = brute_force_allowed(scaled[0].tolist(), 1.0, top_k, top_p, min_p)
    assert all(mask[0, v] for v in allowed) and not any(mask[0, v] for v in truncated)
    assert mask[0, int(scaled.argmax())]


def test_truncated_tokens_are_never_sampled():
    """Over many seeds, every sampled token is inside the top-k / top-p / min-p set."""
    logits = torch.randn(4, 50) * 2
    configs = [(1.0, 5, 0.0, 0.0), (1.0, 0, 0.6, 0.0), (0.8, 0, 0.0, 0.2), (1.5, 10, 0.8, 0.1)]
    num_seeds = 500
    for row, (temperature, top_k, top_p, min_p) in enumerate(configs):
        rows = logits[row].expand(num_seeds, -1)  # [num_seeds, vocab]
        args = params(num_seeds, temperature, top_k, top_p, min_p, seed0=row)
        tokens, _ = sp.sample_reference(rows, *args)
        allowed, _ = brute_force_allowed(logits[row].tolist(), temperature, top_k, top_p, min_p)
        assert set(tokens.tolist()) <= allowed, (row, set(tokens.tolist()) - allowed)
    rows = logits[3].expand(40, -1)
    tokens, _ = sp.sample_triton(rows.to(DEVICE), *(a.to(DEVICE) for a in params(40, *configs[3])))
    assert set(tokens.cpu().tolist()) <= brute_force_allowed(logits[3].tolist(), *configs[3])[0]


CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 0.0, 0.0), (0.7, 0, 0.0, 0.0), (1.3, 6, 0.0, 0.0), (1.0, 0, 0.85, 0.0), (1.0, 8, 0.9, 0.05),
])
def test_sampled_frequencies_match_truncated_softmax(temperature, top_k, top_p, min_p):
    """Chi-square (p = 0.001, fixed seeds: deterministic) of 20,000 samples against
    softmax(logits / T) restricted to the allowed set and renormalised."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.4, -1.0, -2.0, -3.0])
    num_samples = 20_000
    args = params(num_samples, temperature, top_k, top_p, min_p, seed0=42)
    tokens, _ = sp.sample_reference(logits.expand(num_samples, -1), *args)
    allowed, _ = brute_force_allowed(logits.tolist(), temperature, top_k, top_p, min_p)
    probs = torch.softmax(logits.double() / temperature, -1)
    expected = {v: float(probs[v]) for v in allowed}
    total = sum(expected.values())
    counts = torch.bincount(tokens, minlength=len(logits))
    assert int(counts.sum()) == int(sum(counts[v] for v in allowed)), "a truncated token was sampled"
    chi2 = sum((int(counts[v]) - num_samples * p / total) ** 2 / (num_samples * p / total)
               for v, p in expected.items())
    assert chi2 < CHI2_999[len(expected) - 1], (chi2, counts.tolist())


def test_gumbel_noise_is_gumbel_distributed():
    """exp(-exp(-g)) = U must be uniform on (0, 1): deciles balanced (chi2, 9 dof, p = 0.001),
    every value finite."""
    g = sp.gumbel_noise(torch.arange(50, dtype=torch.int64), torch.zeros(50, dtype=torch.int64), 2000)
    assert g.dtype == torch.float32 and g.shape == (50, 2000) and bool(torch.isfinite(g).all())
    u = torch.exp(-torch.exp(-g.double()))
    counts = torch.histc(u, bins=10, min=0, max=1)
    expected = u.numel() / 10
    assert float(((counts - expected) ** 2 / expected).sum()) < 27.88


def exact_gumbel(hi: int, lo: int) -> float:
    """-log(-log(U)) in float64 from the 64-bit integer, with 1 - U taken exactly."""
    k = hi * 2 ** 32 + lo
    if k < 2 ** 63:
        return -math.log(-math.log((k + 0.5) / 2 ** 64))
    return -math.log(-math.log1p(-((2 ** 64 - 1 - k) + 0.5) / 2 ** 64))


def test_noise_has_no_tail_cut_down_to_2_to_the_minus_64():
    """64 random bits map to Gumbel noise exact to float32 rounding at both ends: U within
    2**-64 of 1 (a token of probability ~1e-19 beating the top token) and of 0."""
    mask = 2 ** 32 - 1
    cases = [(mask, mask - k) for k in (0, 1, 7, 1000, 2 ** 20, 2 ** 31)]  # U -> 1
    cases += [(mask - k, 12345) for k in (1, 2 ** 10, 2 ** 24)]
    cases += [(0, k) for k in (0, 1, 2 ** 20)] + [(2 ** 31 - 1, mask), (2 ** 31, 0), (123, 456789)]  # U -> 0, 1/2
    gen = torch.Generator().manual_seed(0)
    cases += [tuple(torch.randint(0, 2 ** 32, (2,), generator=gen).tolist()) for _ in range(200)]
    hi = torch.tensor([c[0] for c in cases], dtype=torch.int64)
    lo = torch.tensor([c[1] for c in cases], dtype=torch.int64)
    got = sp.gumbel_from_bits(hi, lo).double()
    want = torch.tensor([exact_gumbel(*c) for c in cases], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    assert float(got.max()) > 44.0 and float(got.min()) < -3.7  # vs 16.6 and -2.8 with 23-bit uniforms


def test_a_token_of_probability_1e_12_is_sampled_at_its_weight():
    """A constructed distribution: the top token and one of probability 1e-12. The rare
    token wins exactly when its exponential variate E_rare < (p_rare / p_top) E_top, i.e.
    when 1 - U_rare falls below a threshold of ~1e-12: the sampler must put that threshold
    where it belongs (to float32 rounding), on the 64-bit grid of U, so the rare token is
    sampled with probability 1e-12 (a 23-bit uniform cannot come closer than 6e-8 to 1)."""
    p_rare = 1e-12
    scaled = torch.tensor([0.0, math.log(p_rare)])  # [top, rare], T = 1
    top_hi, top_lo = 2 ** 31 + 77, 5  # U_top just above 1/2: E_top = 0.693...
    e_top = -math.log1p(-(((2 ** 32 - 1 - top_hi) * 2 ** 32 + (2 ** 32 - 1 - top_lo)) + 0.5) / 2 ** 64)
    threshold = p_rare * e_top  # the rare token wins iff 1 - U_rare < ~threshold
    mask = 2 ** 32 - 1

    def rare_wins(one_minus_u: float) -> bool:
        k = round(one_minus_u * 2 ** 64)  # 1 - U_rare = (k + 0.5) / 2**64
        hi = torch.tensor([top_hi, mask - (k >> 32)])
        lo = torch.tensor([top_lo, mask - (k & mask)])
        return int((scaled + sp.gumbel_from_bits(hi, lo)).argmax()) == 1

    assert rare_wins(threshold * (1 - 1e-5)) and not rare_wins(threshold * (1 + 1e-5))
    assert rare_wins(threshold / 100) and not rare_wins(threshold * 100)


CHI2_ALPHA = 1e-3
Z_ALPHA = 3.2905  # two-sided normal quantile at CHI2_ALPHA


def frequency_z(logits: torch.Tensor, token: int, p_expected: float, num_draws: int, seed0: int) -> float:
    """z-score of the token's sampled frequency against p_expected (fixed seeds)."""
    args = params(num_draws, seed0=seed0)
    tokens, _ = sp.sample_reference(logits.expand(num_draws, -1), *args)
    freq = float((tokens == token).double().mean())
    return (freq - p_expected) / math.sqrt(p_expected * (1 - p_expected) / num_draws)


def test_sampled_frequency_has_power_to_detect_a_2_percent_bias():
    """A binomial z-test at a false-alarm rate of 1e-3 over 240,000 draws of a p = 0.3
    token: the sampler passes, and the same test rejects a sampler whose p is 2% too high
    (power 0.997 by the normal approximation; fixed seeds make both outcomes fixed)."""
    num_draws, p = 240_000, 0.3
    shift = 0.02 * p / math.sqrt(p * (1 - p) / num_draws)  # the biased sampler's mean z
    power = 0.5 * (1 + math.erf((shift - Z_ALPHA) / math.sqrt(2)))
    assert power > 0.99
    probs = torch.tensor([p, 0.45, 0.2, 0.05], dtype=torch.float64)
    assert abs(frequency_z(probs.log().float(), 0, p, num_draws, seed0=11)) < Z_ALPHA
    biased = probs.clone()
    biased[0], biased[1] = p * 1.02, 0.45 - 0.02 * p
    assert frequency_z(biased.log().float(), 0, p, num_draws, seed0=11) > Z_ALPHA


if sp.triton is not None:
    import triton
    import triton.language as tl

    from kernels.sampling import _gumbel_tl, _hash_tl, _row_key_tl

    @triton.jit
    def _noise_kernel(seeds_ptr, positions_ptr, hi_ptr, lo_ptr, g_ptr, vocab, BLOCK_V: tl.constexpr):
        row = tl.program_id(0)
        seed, pos = tl.load(seeds_ptr + row), tl.load(positions_ptr + row)
        key_hi, key_lo = _row_key_tl(seed, pos, 0x9E3779B9), _row_key_tl(seed, pos, 0x85EBCA77)
        ids = tl.arange(0, BLOCK_V)
        ok = ids < vocab
        tl.store(hi_ptr + row * vocab + ids, _hash_tl(key_hi, ids).to(tl.int64), mask=ok)
        tl.store(lo_ptr + row * vocab + ids, _hash_tl(key_lo, ids).to(tl.int64), mask=ok)
        tl.store(g_ptr + row * vocab + ids, _gumbel_tl(key_hi, key_lo, ids), mask=ok)


@pytest.mark.skipif(sp.triton is None, reason="needs Triton")
def test_triton_rng_is_bit_identical_to_reference():
    """The uint32 hashes in Triton equal the int64-masked hashes in PyTorch bit for bit,
    for negative seeds and positions past 2**32 too; the Gumbel transform agrees to the
    last bit or two (libm logs may round differently)."""
    seeds = torch.tensor([0, 1, -1, 2 ** 62 + 3, -(2 ** 40), 123456789], dtype=torch.int64)
    positions = torch.tensor([0, 1, 2 ** 32 + 5, 7, 2 ** 40, 99], dtype=torch.int64)
    vocab, n = 300, len(seeds)
    hi, lo = (torch.empty(n, vocab, dtype=torch.int64, device=DEVICE) for _ in range(2))
    g = torch.empty(n, vocab, device=DEVICE)
    _noise_kernel[(n,)](seeds.to(DEVICE), positions.to(DEVICE), hi, lo, g, vocab, BLOCK_V=512)
    ids = torch.arange(vocab)[None, :]
    for out, salt in ((hi, sp._ROW_SALT), (lo, sp._ROW_SALT_2)):
        key = sp._row_key(seeds, positions, salt)[:, None]
        assert torch.equal(out.cpu(), sp._mix32(sp._mix32(key ^ ids) ^ key))
    torch.testing.assert_close(g.cpu(), sp.gumbel_noise(seeds, positions, vocab), atol=1e-5, rtol=1e-6)


def mixed_params(n: int, gen: torch.Generator):
    temperature = torch.rand(n, generator=gen) * 1.5 + 0.1
    temperature[::7] = 0.0
    return params(n, temperature=temperature.tolist(), top_k=torch.randint(0, 40, (n,), generator=gen).tolist(),
                  top_p=(torch.rand(n, generator=gen) * (torch.rand(n, generator=gen) < 0.5)).tolist(),
                  min_p=(torch.rand(n, generator=gen) * 0.2 * (torch.rand(n, generator=gen) < 0.5)).tolist())


def test_processed_logprobs_are_normalised_over_the_allowed_tokens():
    """Processed rows: log of softmax(logits / T') restricted to the top-k/top-p/min-p set
    and renormalised; raw rows: the whole vocabulary. Triton == reference."""
    n = 16
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(n, 300, generator=gen) * 2
    args = mixed_params(n, gen)
    processed = torch.arange(n) % 2 == 0
    t_eff = torch.where(args[0] == 0, 1.0, args[0])
    allowed = sp.allowed_mask(logits, t_eff, *args[1:4])
    for tokens, logprobs in both(logits, (*args, processed)):
        scaled = logits.double() / t_eff[:, None].double()
        raw = torch.log_softmax(scaled, -1).gather(1, tokens[:, None]).squeeze(1)
        kept = torch.log_softmax(scaled.masked_fill(~allowed, float("-inf")), -1).gather(1, tokens[:, None]).squeeze(1)
        torch.testing.assert_close(logprobs.double(), torch.where(processed, kept, raw), atol=1e-5, rtol=1e-5)
        assert bool((kept[~processed] >= raw[~processed]).all())  # renormalising can only raise them


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_token_logprobs_are_bitwise_the_sampled_logprobs(path, monkeypatch):
    """token_logprobs(sampled tokens) returns sample()'s logprobs bit for bit, raw and
    processed, on any subset of the rows (what the trainer's reference relies on)."""
    if path == "triton":
        monkeypatch.setenv("RHYMERL_TRITON", "1")  # the dispatchers pick Triton (the interpreter on CPU)
    device = DEVICE if path == "triton" else "cpu"
    n = 24
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(n, 2500, generator=gen) * 3).to(device)
    args = tuple(a.to(device) for a in (*mixed_params(n, gen), torch.arange(n) % 3 == 0))
    sampling, seeds_positions, processed = args[:4], args[4:6], args[6]
    tokens, logprobs = sp.sample(logits, *sampling, *seeds_positions, processed)
    assert torch.equal(sp.token_logprobs(logits, tokens, *sampling, processed), logprobs)
    rows = torch.tensor([3, 17, 4], device=device)
    subset = sp.token_logprobs(logits[rows], tokens[rows], *(a[rows] for a in sampling), processed[rows])
    assert torch.equal(subset, logprobs[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("vocab", [2049, 5000])
def test_split_vocabulary_sampler_is_bitwise_the_one_program_per_row_kernel(dtype, vocab, monkeypatch):
    """At small batches each row's vocabulary is split across programs. Tokens and logprobs
    (raw and processed rows, every truncation, greedy rows with ties across blocks, a
    row whose first block is all -inf) are the one-program kernel's bit for bit, and the
    tokens are the reference's: the path taken can never change a sample or a logprob."""
    n = 9
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(n, vocab, generator=gen) * 3
    logits[0, [10, vocab - 1]] = 50.0  # rows 0 and 7 are greedy (mixed_params): ties go to the lowest id
    logits[7, [2047, 2048]] = 50.0  # across the block boundary
    logits[3, :2048] = float("-inf")  # a whole block the logsumexp and argmax must skip
    logits = logits.to(dtype)
    args = (*mixed_params(n, gen), torch.arange(n) % 2 == 0)
    on_device = (logits.to(DEVICE), *(a.to(DEVICE) for a in args))
    whole_tokens, whole_lp = sp.sample_triton(*on_device, split=False)
    split_tokens, split_lp = sp.sample_triton(*on_device, split=True)
    assert torch.equal(split_tokens, whole_tokens) and torch.equal(split_lp, whole_lp)
    assert split_tokens[0] == 10 and split_tokens[7] == 2047
    assert torch.equal(split_tokens.cpu(), sp.sample_reference(logits, *args)[0])
    monkeypatch.setenv("RHYMERL_TRITON", "1")  # token_logprobs' Triton kernel (the interpreter on CPU)
    assert torch.equal(sp.token_logprobs(logits.to(DEVICE), split_tokens, *on_device[1:5], on_device[7]), split_lp)


def test_the_sampler_splits_the_vocabulary_at_small_batches_only(monkeypatch):
    """Up to SPLIT_MAX_ROWS rows the split kernels run (one combining program per row),
    above it one program per row."""
    calls = []
    real = sp._split_combine_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]
    monkeypatch.setattr(sp, "_split_combine_kernel", Spy())
    for n in (1, sp.SPLIT_MAX_ROWS, sp.SPLIT_MAX_ROWS + 1):
        logits = torch.randn(n, 2100, generator=torch.Generator().manual_seed(n)).to(DEVICE)
        sp.sample_triton(logits, *(a.to(DEVICE) for a in params(n)))
    assert calls == [(1,), (sp.SPLIT_MAX_ROWS,)]
