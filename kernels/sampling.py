"""Lossless, reproducible token sampling: Gumbel-max with a counter-based RNG.

    token = argmax over allowed v of (logits[v] / T + g(seed, position, v))

g is Gumbel noise -log(E), E = -log(U) an exponential variate, U a pure function of
(seed, position, v) with 64 random bits (see ``gumbel_noise``), so a row's token depends
only on its logits, parameters, seed and position: not on batch size, order or
neighbours. This is what makes speculative decoding lossless and reproducible: a draft
token at position p is accepted exactly when it equals the token sampled at p, and the
token drawn after a rejection is the same one a run without speculation would have drawn.

Why 64 bits: a token v beats the top token t when E_v / p_v < E_t / p_t, so a token of
probability p is reached through E_v ~ p, i.e. U within ~p of 1. With 23-bit uniforms E
could not go below ~6e-8 (tokens under ~4e-9 of the top token were never sampled, and
those under ~1e-7 slightly mis-weighted). Here U is built from two 32-bit hashes of two
independent 32-bit row keys, and E is computed from whichever of U and 1 - U is below
one half (``-log(U)`` or ``-log1p(-(1 - U))``), both exact to float32 rounding down to
2**-64: any token with probability above ~1e-18 can be sampled, at its own weight.

"allowed" applies top_k, then top_p (smallest set whose probability under the top-k
renormalised softmax(logits / T) reaches top_p), then min_p (p >= min_p * p_max).
T == 0 means greedy (argmax, ties to the lowest id). The returned logprob of the token is
log_softmax(logits / T')[token], T' = T or 1 when greedy, normalised over the whole
vocabulary ("raw", what a trainer recomputes from the policy), or over the allowed tokens
only ("processed": the distribution actually sampled from). ``token_logprobs`` returns
the same number, bit for bit, for tokens given by the caller (the trainer's reference).

This module knows nothing about requests or speculation: it sees rows of logits.
"""

from __future__ import annotations

import torch

from kernels import gumbel_native
from kernels.paged_attention import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None

_MASK32 = 0xFFFFFFFF
_MIX_MUL_1 = 0x7FEB352D  # lowbias32 multipliers (C. Wellons' integer hash prospector)
_MIX_MUL_2 = 0x846CA68B
_ROW_SALT = 0x9E3779B9  # golden ratio: separates the first row key from raw seed bits
_ROW_SALT_2 = 0x85EBCA77  # a second, independent row key (32 more bits of U)
_HALF = 1 << 31
_TWO_M32 = 2.0 ** -32  # exact in float32
_TWO_M64 = 2.0 ** -64


# ------------------------------------------------------------------------- the RNG


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without int64 overflow."""
    lo = x * (c & 0xFFFF)  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # the product's bits 16..31
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective 32-bit mixer, on uint32 values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_MUL_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_MUL_2)
    return x ^ (x >> 16)


def _row_key(seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:  # [n] in [0, 2**32)
    key = _mix32((seeds & _MASK32) ^ salt)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (positions & _MASK32))
    return _mix32(key ^ ((positions >> 32) & _MASK32))


def _unit(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """(hi * 2**32 + lo + 0.5) * 2**-64 in float32: exact to rounding however small."""
    return hi.to(torch.float32) * _TWO_M32 + (lo.to(torch.float32) + 0.5) * _TWO_M64


def _neg_log1p_neg(w: torch.Tensor) -> torch.Tensor:
    """-log(1 - w) for w in (0, 1/2], accurate for tiny w (Goldberg's log1p: the rounding
    of 1 - w cancels in log(u) / (u - 1))."""
    u = 1.0 - w
    return torch.where(u == 1.0, w, w * (torch.log(u) / (u - 1.0)))


def gumbel_from_bits(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """Gumbel noise -log(-log(U)), U = (hi * 2**32 + lo + 0.5) / 2**64.

    Args:
        hi, lo: the same shape, uint32 values held in int64.
    Returns:
        float32 noise, finite: in about [-3.8, 44.4].
    """
    low_half = hi < _HALF
    exp_low = -torch.log(_unit(hi, lo))  # U < 1/2: -log(U) directly
    exp_high = _neg_log1p_neg(_unit(hi ^ _MASK32, lo ^ _MASK32))  # U >= 1/2: from 1 - U, exactly
    return -torch.log(torch.where(low_half, exp_low, exp_high))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The reference RNG: g[i, v], a pure function of (seeds[i], positions[i], v).

    Args:
        seeds: [n] int64.
        positions: [n] int64.
    Returns:
        [n, vocab_size] float32 Gumbel noise.
    """
    seeds, positions = seeds.long(), positions.long()
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)[None, :]  # [1, vocab]
    key_hi = _row_key(seeds, positions, _ROW_SALT)[:, None]  # [n, 1]
    key_lo = _row_key(seeds, positions, _ROW_SALT_2)[:, None]
    hi = _mix32(_mix32(key_hi ^ ids) ^ key_hi)  # [n, vocab]
    lo = _mix32(_mix32(key_lo ^ ids) ^ key_lo)
    return gumbel_from_bits(hi, lo)


# ---------------------------------------------------------------------- truncation


def allowed_mask(
    logits: torch.Tensor,  # [n, vocab], any float dtype
    temperature: torch.Tensor,  # [n] float32, > 0 (greedy rows pass 1)
    top_k: torch.Tensor,  # [n] int32, 0 = off
    top_p: torch.Tensor,  # [n] float32, 0 or 1 = off
    min_p: torch.Tensor,  # [n] float32, 0 = off
    truncation: tuple[bool, bool] | None = None,
) -> torch.Tensor | None:  # [n, vocab] bool, or None when no row truncates
    """Which tokens each row may sample under softmax(logits / temperature).
    The argmax token is always allowed (for min_p <= 1).

    ``truncation``: (any row has top-k or top-p on, any row has min-p on), when the
    caller knows it from host data; None: read from the tensors (a host sync on a GPU)."""
    vocab = logits.shape[1]
    k_on = (top_k > 0) & (top_k < vocab)  # [n]
    p_on = (top_p > 0) & (top_p < 1)  # [n]
    if truncation is None:  # one host sync decides which (costly) parts run at all
        truncation = torch.stack([(k_on | p_on).any(), (min_p > 0).any()]).tolist()
    need_sort, need_min_p = truncation
    if not (need_sort or need_min_p):
        return None
    scaled = logits.float() / temperature[:, None]  # [n, vocab]
    allowed = torch.ones_like(scaled, dtype=torch.bool)  # [n, vocab]
    if need_sort:
        # Stable sort: among equal logits the lower id ranks first, so ties at the
        # boundary resolve the same way on every device and batch.
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [n, vocab]
        rank = torch.arange(vocab, device=scaled.device)  # [vocab]
        keep = torch.where(k_on, top_k.long(), vocab)  # [n]
        keep_sorted = rank[None, :] < keep[:, None]  # [n, vocab]
        probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)  # [n, vocab]
        mass_before = torch.cumsum(probs, dim=-1) - probs  # [n, vocab], exclusive
        keep_sorted &= ~p_on[:, None] | (mass_before < top_p[:, None])
        allowed = torch.zeros_like(allowed).scatter_(1, order, keep_sorted)
    if need_min_p:
        # p / p_max = exp(scaled - max): no normalisation needed.
        ratio = torch.exp(scaled - scaled.max(dim=-1, keepdim=True).values)  # [n, vocab]
        allowed &= ratio >= min_p[:, None]
    return allowed


# ---------------------------------------------------------------------- sampling


def _scale(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits / T' in float32 [n, vocab], T' [n]): T' = T, or 1 for greedy rows."""
    t = torch.where(temperature == 0, torch.ones_like(temperature), temperature)  # [n]
    return logits.float() / t[:, None], t


def _logprobs_reference(scaled, allowed, processed, tokens) -> torch.Tensor:  # [n] float32
    """log_softmax(scaled)[token], over the allowed tokens only in processed rows."""
    if allowed is not None and processed is not None:  # (no-op on raw rows: no host check needed)
        scaled = torch.where(allowed | ~processed[:, None], scaled, float("-inf"))
    return torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def sample_reference(logits, temperature, top_k, top_p, min_p, seeds, positions, processed=None, truncation=None,
                     noise_fn=gumbel_noise):
    """The ground truth in PyTorch; see the module docstring for the contract. ``noise_fn``:
    the RNG (``gumbel_noise``, or the same noise from ``_cpu_noise``)."""
    _check_args(logits, temperature, top_k, top_p, min_p, processed, seeds=seeds, positions=positions)
    scaled, t = _scale(logits, temperature)  # [n, vocab]
    noise = noise_fn(seeds, positions, logits.shape[1])  # [n, vocab]
    allowed = allowed_mask(logits, t, top_k, top_p, min_p, truncation)
    tokens = _gumbel_argmax(scaled, temperature, noise, allowed)
    return tokens, _logprobs_reference(scaled, allowed, processed, tokens)


def _gumbel_argmax(scaled, temperature, noise, allowed) -> torch.Tensor:  # [n] int64
    """Each row's first best of scaled + noise (greedy rows: of scaled) over its allowed tokens."""
    scores = scaled + torch.where((temperature == 0)[:, None], 0.0, noise)  # [n, vocab]
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.argmax(dim=-1)


# At most this many rows, ``sample_triton`` splits each row's vocabulary across programs
# (``_split_*`` kernels): one program per row would leave most of a GPU idle (1 of 132 SMs
# at batch 1, reading a 151,936-token row alone). Not tuned on a GPU; either path gives
# the same tokens and logprobs, bit for bit.
SPLIT_MAX_ROWS = 64


def sample_triton(logits, temperature, top_k, top_p, min_p, seeds, positions, processed=None, truncation=None,
                  split: bool | None = None):
    """Truncation mask from PyTorch (it needs a sort); RNG, Gumbel, argmax and
    logsumexp fused over each row's vocabulary: in one program per row, or, at up to
    SPLIT_MAX_ROWS rows (``split`` None) or when ``split``, in one program per vocabulary
    block of each row with the same arithmetic (``_launch``)."""
    _check_args(logits, temperature, top_k, top_p, min_p, processed, seeds=seeds, positions=positions)
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)  # [n]
    if split is None:
        split = logits.shape[0] <= SPLIT_MAX_ROWS
    return tokens, _launch(logits, temperature, top_k, top_p, min_p, processed, tokens, seeds, positions,
                           truncation, split)


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions, processed=None, truncation=None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: [n, vocab], any float dtype (math in float32).
        temperature, top_p, min_p: [n] float32. top_k: [n] int32 (0 = off).
        seeds, positions: [n] int64.
        processed: [n] bool, rows whose logprob is normalised over the allowed tokens
            only (None: every row raw).
        truncation: (any row uses top-k or top-p, any row uses min-p) when known on the
            host, so nothing waits for the device to decide it (``allowed_mask``).
    Returns:
        tokens [n] int64 and their logprobs [n] float32 (see the module docstring).
    """
    if use_triton(logits):
        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds, positions, processed, truncation)
    if logits.device.type == "cpu":
        return _sample_cpu(logits, temperature, top_k, top_p, min_p, seeds, positions, processed, truncation)
    return sample_reference(logits, temperature, top_k, top_p, min_p, seeds, positions, processed, truncation)


def _sample_cpu(logits, temperature, top_k, top_p, min_p, seeds, positions, processed=None, truncation=None):
    """``sample_reference`` on the CPU, the same tokens and logprobs bit for bit: rows
    without truncation take their token from ``gumbel_native.sample_screened`` (the noise
    of a few candidates per row, not of the whole vocabulary), the others from the full
    noise (``_cpu_noise``); without the compiled library, the reference itself."""
    if not gumbel_native.available():
        return sample_reference(logits, temperature, top_k, top_p, min_p, seeds, positions, processed, truncation,
                                _cpu_noise)
    _check_args(logits, temperature, top_k, top_p, min_p, processed, seeds=seeds, positions=positions)
    scaled, t = _scale(logits, temperature)  # [n, vocab]
    allowed = allowed_mask(logits, t, top_k, top_p, min_p, truncation)
    if allowed is not None:
        tokens = _gumbel_argmax(scaled, temperature, _cpu_noise(seeds, positions, logits.shape[1]), allowed)
    else:  # greedy rows: the argmax itself; the others: screened Gumbel-max
        tokens = torch.where(temperature == 0, scaled.argmax(dim=-1),
                             gumbel_native.sample_screened(scaled, seeds, positions))
    return tokens, _logprobs_reference(scaled, allowed, processed, tokens)


def _cpu_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``gumbel_noise``, bit for bit, with its hashing compiled (kernels/gumbel_native.py)
    when `make install` built it; else the reference itself."""
    noise = gumbel_native.gumbel_noise(seeds, positions, vocab_size)
    return noise if noise is not None else gumbel_noise(seeds, positions, vocab_size)


def token_logprobs(logits, tokens, temperature, top_k, top_p, min_p, processed=None) -> torch.Tensor:
    """The logprob ``sample`` returns when it samples ``tokens`` from these rows, bit for
    bit on the same device: what a trainer's reference computes for the rollout's tokens.

    Args:
        logits, temperature, top_k, top_p, min_p, processed: as for ``sample``.
        tokens: [n] int64, the token of each row.
    Returns:
        [n] float32 (-inf for a token outside the allowed set of a processed row).
    """
    _check_args(logits, temperature, top_k, top_p, min_p, processed, tokens=tokens)
    if use_triton(logits):
        return _launch(logits, temperature, top_k, top_p, min_p, processed, tokens)
    scaled, t = _scale(logits, temperature)
    return _logprobs_reference(scaled, allowed_mask(logits, t, top_k, top_p, min_p), processed, tokens)


def _launch(logits, temperature, top_k, top_p, min_p, processed, tokens, seeds=None, positions=None,
            truncation=None, split=False):
    """Runs the sampling kernel (seeds given: ``tokens`` is written; ``split``: the
    split-vocabulary kernels) or the logprob kernel (``tokens`` is read); returns the
    logprobs."""
    n, vocab = logits.shape
    assert logits.stride(1) == 1, logits.stride()
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)  # [n]
    if n == 0:
        return logprobs
    t = torch.where(temperature == 0, torch.ones_like(temperature), temperature)  # [n]
    allowed = allowed_mask(logits, t, top_k, top_p, min_p, truncation)  # [n, vocab] | None
    mask = allowed if allowed is not None else logprobs  # an unread placeholder pointer
    flags = (processed if processed is not None else torch.zeros(n, dtype=torch.bool, device=logits.device))
    flags = flags.to(torch.int8)  # [n]
    common = dict(HAS_MASK=allowed is not None, BLOCK_V=min(2048, triton.next_power_of_2(vocab)))
    num_blocks = triton.cdiv(vocab, common["BLOCK_V"])
    if seeds is None:
        _logprob_kernel[(n,)](logits, mask, temperature, flags, tokens, logprobs, logits.stride(0), vocab, **common)
    elif split and num_blocks > 1:
        # Per (row, block): the best score and its token, the block's max of what the
        # logsumexp sums, then the block's sum under the running max up to it; one program
        # per row then combines the blocks in order, as the one-program loop does.
        best = torch.empty(n, num_blocks, dtype=torch.float32, device=logits.device)  # [n, blocks]
        best_token = torch.empty(n, num_blocks, dtype=torch.int64, device=logits.device)
        block_max = torch.empty(n, num_blocks, dtype=torch.float32, device=logits.device)
        block_sum = torch.empty(n, num_blocks, dtype=torch.float32, device=logits.device)
        _split_max_kernel[(n, num_blocks)](logits, mask, temperature, flags, seeds, positions, best, best_token,
                                           block_max, logits.stride(0), vocab, num_blocks, **common)
        _split_sum_kernel[(n, num_blocks)](logits, mask, temperature, flags, block_max, block_sum, logits.stride(0),
                                           vocab, num_blocks, BLOCKS=triton.next_power_of_2(num_blocks), **common)
        _split_combine_kernel[(n,)](logits, temperature, best, best_token, block_max, block_sum, tokens, logprobs,
                                    logits.stride(0), num_blocks)
    else:
        _sample_kernel[(n,)](logits, mask, temperature, flags, seeds, positions, tokens, logprobs,
                             logits.stride(0), vocab, **common)
    return logprobs


def _check_args(logits, temperature, top_k, top_p, min_p, processed, **int64_rows) -> None:
    assert logits.dim() == 2 and logits.dtype.is_floating_point, (logits.shape, logits.dtype)
    n = logits.shape[0]
    rows = [("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
            ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32)]
    rows += [(name, t, torch.int64) for name, t in int64_rows.items()]
    if processed is not None:
        rows.append(("processed", processed, torch.bool))
    for name, t, dtype in rows:
        assert t.shape == (n,) and t.dtype == dtype, (name, t.shape, t.dtype)
        assert t.device == logits.device, (name, t.device, logits.device)


# ------------------------------------------------------------------------ Triton kernels

if triton is not None:

    @triton.jit
    def _mix32_tl(x):
        """lowbias32 on uint32; must stay bit-identical to ``_mix32``."""
        x = x ^ (x >> 16)
        x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
        x = x ^ (x >> 15)
        x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
        return x ^ (x >> 16)

    @triton.jit
    def _row_key_tl(seed, pos, SALT: tl.constexpr):
        """``_row_key`` for one int64 seed and position."""
        key = _mix32_tl((seed & 0xFFFFFFFF).to(tl.uint32) ^ tl.full([], SALT, tl.uint32))
        key = _mix32_tl(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        key = _mix32_tl(key ^ (pos & 0xFFFFFFFF).to(tl.uint32))
        return _mix32_tl(key ^ ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32))

    @triton.jit
    def _unit_tl(hi, lo):
        """``_unit``: the two float32 products and the sum in the same order."""
        return hi.to(tl.float32) * 2.3283064365386963e-10 + (lo.to(tl.float32) + 0.5) * 5.421010862427522e-20

    @triton.jit
    def _gumbel_from_bits_tl(hi, lo):
        """``gumbel_from_bits`` on uint32 blocks."""
        ones = tl.full(hi.shape, 0xFFFFFFFF, tl.uint32)
        exp_low = -tl.log(_unit_tl(hi, lo))
        w = _unit_tl(hi ^ ones, lo ^ ones)
        u = 1.0 - w
        exp_high = tl.where(u == 1.0, w, w * tl.math.div_rn(tl.log(u), u - 1.0))
        return -tl.log(tl.where(hi < tl.full(hi.shape, 0x80000000, tl.uint32), exp_low, exp_high))

    @triton.jit
    def _hash_tl(key, ids):
        """The 32 random bits of each token id under one row key (``gumbel_noise``'s hi, lo)."""
        return _mix32_tl(_mix32_tl(key ^ ids.to(tl.uint32)) ^ key)

    @triton.jit
    def _gumbel_tl(key_hi, key_lo, ids):
        """``gumbel_noise`` for one row's two keys and a block of token ids."""
        return _gumbel_from_bits_tl(_hash_tl(key_hi, ids), _hash_tl(key_lo, ids))

    @triton.jit
    def _scaled_block(logits_ptr, mask_ptr, row, stride_row, vocab, start, t, processed,
                      HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr):
        """One vocabulary block of a row: (ids, logits / T', allowed, what its logsumexp sums)."""
        ids = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        ok = ids < vocab
        x = tl.load(logits_ptr + row * stride_row + ids, mask=ok, other=float("-inf")).to(tl.float32)
        scaled = tl.math.div_rn(x, t)  # [BLOCK_V]; IEEE like torch (plain / is approximate)
        allowed = ok
        if HAS_MASK:
            allowed = tl.load(mask_ptr + row * vocab + ids, mask=ok, other=0) != 0
        lse_in = tl.where(allowed | (processed == 0), scaled, float("-inf"))
        return ids, scaled, allowed, lse_in

    @triton.jit
    def _row_sampling(temperature_ptr, processed_ptr, seeds_ptr, positions_ptr, row):
        """A row's sampling state: greedy, the temperature divided by (1 when greedy), whether
        its logits are already processed, and its noise key (seed, position)."""
        temperature = tl.load(temperature_ptr + row)
        greedy = temperature == 0.0
        t = tl.where(greedy, 1.0, temperature)
        processed = tl.load(processed_ptr + row)
        seed, pos = tl.load(seeds_ptr + row), tl.load(positions_ptr + row)
        return greedy, t, processed, _row_key_tl(seed, pos, 0x9E3779B9), _row_key_tl(seed, pos, 0x85EBCA77)

    @triton.jit
    def _block_scores(logits_ptr, mask_ptr, row, stride_row, vocab, start, t, processed, greedy, key_hi, key_lo,
                      HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr):
        """One vocabulary block's Gumbel-max scores (-inf where not allowed) and its logsumexp input."""
        ids, scaled, allowed, lse_in = _scaled_block(logits_ptr, mask_ptr, row, stride_row, vocab, start, t,
                                                     processed, HAS_MASK, BLOCK_V)
        noise = tl.where(greedy, 0.0, _gumbel_tl(key_hi, key_lo, ids))
        return tl.where(allowed, scaled + noise, float("-inf")), lse_in

    @triton.jit
    def _lse_step(run_max, run_sum, x):
        """Online logsumexp; masked (-inf) entries may fill whole blocks, so exp() never
        sees -inf - -inf."""
        new_max = tl.maximum(run_max, tl.max(x, axis=0))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        return new_max, run_sum * tl.exp(run_max - safe_max) + tl.sum(tl.exp(x - safe_max), axis=0)

    @triton.jit
    def _sample_kernel(
        logits_ptr, mask_ptr, temperature_ptr, processed_ptr, seeds_ptr, positions_ptr, tokens_ptr, logprobs_ptr,
        stride_row, vocab,
        HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        greedy, t, processed, key_hi, key_lo = _row_sampling(temperature_ptr, processed_ptr, seeds_ptr,
                                                             positions_ptr, row)

        best_score = tl.full([], float("-inf"), tl.float32)
        best_token = tl.full([], 0, tl.int64)
        run_max = tl.full([], float("-inf"), tl.float32)  # online logsumexp of scaled
        run_sum = tl.full([], 0.0, tl.float32)
        for start in range(0, vocab, BLOCK_V):
            score, lse_in = _block_scores(logits_ptr, mask_ptr, row, stride_row, vocab, start, t, processed,
                                          greedy, key_hi, key_lo, HAS_MASK, BLOCK_V)
            block_best = tl.max(score, axis=0)
            block_arg = tl.argmax(score, axis=0)  # ties to the lowest id
            # Strictly greater: an earlier block keeps ties, so ties go to the lowest id overall.
            better = block_best > best_score
            best_token = tl.where(better, (start + block_arg).to(tl.int64), best_token)
            best_score = tl.where(better, block_best, best_score)
            run_max, run_sum = _lse_step(run_max, run_sum, lse_in)
        tl.store(tokens_ptr + row, best_token)
        best_scaled = tl.math.div_rn(tl.load(logits_ptr + row * stride_row + best_token).to(tl.float32), t)
        tl.store(logprobs_ptr + row, best_scaled - run_max - tl.log(run_sum))

    @triton.jit
    def _split_max_kernel(
        logits_ptr, mask_ptr, temperature_ptr, processed_ptr, seeds_ptr, positions_ptr, best_ptr, best_token_ptr,
        block_max_ptr, stride_row, vocab, num_blocks,
        HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        """Block (program_id 1) of a row: ``_sample_kernel``'s loop body for that block,
        up to the running state: its best score and token, and the max of its logsumexp
        input. Max and argmax are exact, so any order of blocks gives the same."""
        row, block = tl.program_id(0), tl.program_id(1)
        greedy, t, processed, key_hi, key_lo = _row_sampling(temperature_ptr, processed_ptr, seeds_ptr,
                                                             positions_ptr, row)
        start = block * BLOCK_V
        score, lse_in = _block_scores(logits_ptr, mask_ptr, row, stride_row, vocab, start, t, processed,
                                      greedy, key_hi, key_lo, HAS_MASK, BLOCK_V)
        out = row * num_blocks + block
        tl.store(best_ptr + out, tl.max(score, axis=0))
        tl.store(best_token_ptr + out, (start + tl.argmax(score, axis=0)).to(tl.int64))  # ties to the lowest id
        tl.store(block_max_ptr + out, tl.max(lse_in, axis=0))

    @triton.jit
    def _split_sum_kernel(
        logits_ptr, mask_ptr, temperature_ptr, processed_ptr, block_max_ptr, block_sum_ptr, stride_row, vocab,
        num_blocks,
        HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr, BLOCKS: tl.constexpr,
    ):
        """Block of a row: the sum ``_lse_step`` adds for it, sum(exp(x - m)), m the running
        max after it (the max over this block and those before: exact in any order)."""
        row, block = tl.program_id(0), tl.program_id(1)
        temperature = tl.load(temperature_ptr + row)
        t = tl.where(temperature == 0.0, 1.0, temperature)
        processed = tl.load(processed_ptr + row)
        upto = tl.arange(0, BLOCKS)
        run_max = tl.max(tl.load(block_max_ptr + row * num_blocks + upto, mask=upto <= block, other=float("-inf")),
                         axis=0)
        safe_max = tl.where(run_max == float("-inf"), 0.0, run_max)
        _, _, _, lse_in = _scaled_block(logits_ptr, mask_ptr, row, stride_row, vocab, block * BLOCK_V, t,
                                        processed, HAS_MASK, BLOCK_V)
        tl.store(block_sum_ptr + row * num_blocks + block, tl.sum(tl.exp(lse_in - safe_max), axis=0))

    @triton.jit
    def _split_combine_kernel(
        logits_ptr, temperature_ptr, best_ptr, best_token_ptr, block_max_ptr, block_sum_ptr, tokens_ptr,
        logprobs_ptr, stride_row, num_blocks,
    ):
        """``_sample_kernel``'s running state over the blocks, in its order and arithmetic."""
        row = tl.program_id(0)
        temperature = tl.load(temperature_ptr + row)
        t = tl.where(temperature == 0.0, 1.0, temperature)
        best_score = tl.full([], float("-inf"), tl.float32)
        best_token = tl.full([], 0, tl.int64)
        run_max = tl.full([], float("-inf"), tl.float32)
        run_sum = tl.full([], 0.0, tl.float32)
        for block in range(0, num_blocks):
            at = row * num_blocks + block
            block_best = tl.load(best_ptr + at)
            better = block_best > best_score  # an earlier block keeps ties: the lowest id overall
            best_token = tl.where(better, tl.load(best_token_ptr + at), best_token)
            best_score = tl.where(better, block_best, best_score)
            new_max = tl.maximum(run_max, tl.load(block_max_ptr + at))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe_max) + tl.load(block_sum_ptr + at)
            run_max = new_max
        tl.store(tokens_ptr + row, best_token)
        best_scaled = tl.math.div_rn(tl.load(logits_ptr + row * stride_row + best_token).to(tl.float32), t)
        tl.store(logprobs_ptr + row, best_scaled - run_max - tl.log(run_sum))

    @triton.jit
    def _logprob_kernel(
        logits_ptr, mask_ptr, temperature_ptr, processed_ptr, tokens_ptr, logprobs_ptr, stride_row, vocab,
        HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        """``_sample_kernel``'s logsumexp, for a given token: the same operations in the
        same order, so the same bits."""
        row = tl.program_id(0)
        temperature = tl.load(temperature_ptr + row)
        t = tl.where(temperature == 0.0, 1.0, temperature)
        processed = tl.load(processed_ptr + row)
        run_max = tl.full([], float("-inf"), tl.float32)
        run_sum = tl.full([], 0.0, tl.float32)
        for start in range(0, vocab, BLOCK_V):
            _, _, _, lse_in = _scaled_block(logits_ptr, mask_ptr, row, stride_row, vocab, start, t, processed,
                                            HAS_MASK, BLOCK_V)
            run_max, run_sum = _lse_step(run_max, run_sum, lse_in)
        token = tl.load(tokens_ptr + row)
        scaled = tl.math.div_rn(tl.load(logits_ptr + row * stride_row + token).to(tl.float32), t)
        if HAS_MASK:  # a token the processed distribution excludes has probability 0
            scaled = tl.where((tl.load(mask_ptr + row * vocab + token) != 0) | (processed == 0), scaled,
                              float("-inf"))
        tl.store(logprobs_ptr + row, scaled - run_max - tl.log(run_sum))
