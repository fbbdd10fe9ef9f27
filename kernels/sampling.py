"""Lossless, reproducible token sampling: Gumbel-max with a counter-based RNG.

    token = argmax over allowed v of (logits[v] / T + g(seed, position, v))

g is Gumbel noise -log(-log(u)), u a pure function of (seed, position, v) (see
``uniform_noise``), so a row's token depends only on its logits, parameters, seed and
position: not on batch size, order or neighbours. This is what makes speculative
decoding lossless and reproducible: a draft token at position p is accepted exactly when
it equals the token sampled at p, and the token drawn after a rejection is the same one
a run without speculation would have drawn.

"allowed" applies top_k, then top_p (smallest set whose probability under the top-k
renormalised softmax(logits / T) reaches top_p), then min_p (p >= min_p * p_max).
T == 0 means greedy (argmax, ties to the lowest id). Returned logprobs are
log_softmax(logits / T')[token], T' = T or 1 when greedy, over the whole vocabulary:
what a trainer recomputes from the policy.

This module knows nothing about requests or speculation: it sees rows of logits.
"""

from __future__ import annotations

import torch

from kernels.paged_attention import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference path needs no Triton
    triton = None

_MASK32 = 0xFFFFFFFF
_MIX_MUL_1 = 0x7FEB352D  # lowbias32 multipliers (C. Wellons' integer hash prospector)
_MIX_MUL_2 = 0x846CA68B
_ROW_SALT = 0x9E3779B9  # golden ratio: separates the row key from raw seed bits
_UNIFORM_BITS = 23  # (k + 0.5) * 2**-23 is exact in float32 and strictly inside (0, 1)


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


def _row_key(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [n] int64 in [0, 2**32)
    key = _mix32((seeds & _MASK32) ^ _ROW_SALT)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (positions & _MASK32))
    return _mix32(key ^ ((positions >> 32) & _MASK32))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The reference RNG: u[i, v] in (0, 1), a pure function of (seeds[i], positions[i], v).

    Args:
        seeds: [n] int64.
        positions: [n] int64.
    Returns:
        [n, vocab_size] float32.
    """
    key = _row_key(seeds.long(), positions.long())  # [n]
    ids = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [vocab]
    h = _mix32(_mix32(key[:, None] ^ ids[None, :]) ^ key[:, None])  # [n, vocab]
    k = (h >> (32 - _UNIFORM_BITS)).to(torch.float32)  # exact: < 2**23
    return (k + 0.5) * (2.0 ** -_UNIFORM_BITS)


# ---------------------------------------------------------------------- truncation


def allowed_mask(
    logits: torch.Tensor,  # [n, vocab], any float dtype
    temperature: torch.Tensor,  # [n] float32, > 0 (greedy rows pass 1)
    top_k: torch.Tensor,  # [n] int32, 0 = off
    top_p: torch.Tensor,  # [n] float32, 0 or 1 = off
    min_p: torch.Tensor,  # [n] float32, 0 = off
) -> torch.Tensor | None:  # [n, vocab] bool, or None when no row truncates
    """Which tokens each row may sample under softmax(logits / temperature).
    The argmax token is always allowed (for min_p <= 1)."""
    vocab = logits.shape[1]
    k_on = (top_k > 0) & (top_k < vocab)  # [n]
    p_on = (top_p > 0) & (top_p < 1)  # [n]
    min_p_on = min_p > 0  # [n]
    # One host sync decides which (costly) parts run at all.
    need_sort, need_min_p = torch.stack([(k_on | p_on).any(), min_p_on.any()]).tolist()
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


def sample_reference(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """The ground truth in PyTorch; see the module docstring for the contract."""
    _check_args(logits, temperature, top_k, top_p, min_p, seeds, positions)
    x = logits.float()  # [n, vocab]
    greedy = temperature == 0  # [n]
    t = torch.where(greedy, torch.ones_like(temperature), temperature)  # [n]
    scaled = x / t[:, None]  # [n, vocab]
    u = uniform_noise(seeds, positions, x.shape[1])  # [n, vocab]
    noise = torch.where(greedy[:, None], 0.0, -torch.log(-torch.log(u)))  # [n, vocab]
    scores = scaled + noise  # [n, vocab]
    allowed = allowed_mask(logits, t, top_k, top_p, min_p)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    tokens = scores.argmax(dim=-1)  # [n]
    logprobs = torch.log_softmax(scaled, dim=-1).gather(1, tokens[:, None]).squeeze(1)  # [n]
    return tokens, logprobs


def sample_triton(logits, temperature, top_k, top_p, min_p, seeds, positions):
    """Truncation mask from PyTorch (it needs a sort); RNG, Gumbel, argmax and
    logsumexp fused in one pass over each row's vocabulary."""
    _check_args(logits, temperature, top_k, top_p, min_p, seeds, positions)
    n, vocab = logits.shape
    assert logits.stride(1) == 1, logits.stride()
    tokens = torch.empty(n, dtype=torch.int64, device=logits.device)  # [n]
    logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)  # [n]
    if n == 0:
        return tokens, logprobs
    t = torch.where(temperature == 0, torch.ones_like(temperature), temperature)  # [n]
    allowed = allowed_mask(logits, t, top_k, top_p, min_p)  # [n, vocab] | None
    mask = allowed if allowed is not None else tokens  # an unread placeholder pointer
    _sample_kernel[(n,)](
        logits, mask, temperature, seeds, positions, tokens, logprobs,
        logits.stride(0), vocab,
        HAS_MASK=allowed is not None, BLOCK_V=min(2048, triton.next_power_of_2(vocab)),
    )
    return tokens, logprobs


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row.

    Args:
        logits: [n, vocab], any float dtype (math in float32).
        temperature, top_p, min_p: [n] float32. top_k: [n] int32 (0 = off).
        seeds, positions: [n] int64.
    Returns:
        tokens [n] int64 and their logprobs [n] float32 (untruncated, see module docstring).
    """
    if use_triton(logits):
        return sample_triton(logits, temperature, top_k, top_p, min_p, seeds, positions)
    return sample_reference(logits, temperature, top_k, top_p, min_p, seeds, positions)


def _check_args(logits, temperature, top_k, top_p, min_p, seeds, positions) -> None:
    assert logits.dim() == 2 and logits.dtype.is_floating_point, (logits.shape, logits.dtype)
    n = logits.shape[0]
    for name, t, dtype in (("temperature", temperature, torch.float32), ("top_k", top_k, torch.int32),
                           ("top_p", top_p, torch.float32), ("min_p", min_p, torch.float32),
                           ("seeds", seeds, torch.int64), ("positions", positions, torch.int64)):
        assert t.shape == (n,) and t.dtype == dtype, (name, t.shape, t.dtype)
        assert t.device == logits.device, (name, t.device, logits.device)


# ------------------------------------------------------------------------ Triton kernel

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
    def _row_key_tl(seed, pos):
        """``_row_key`` for one int64 seed and position."""
        key = _mix32_tl((seed & 0xFFFFFFFF).to(tl.uint32) ^ tl.full([], 0x9E3779B9, tl.uint32))
        key = _mix32_tl(key ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        key = _mix32_tl(key ^ (pos & 0xFFFFFFFF).to(tl.uint32))
        return _mix32_tl(key ^ ((pos >> 32) & 0xFFFFFFFF).to(tl.uint32))

    @triton.jit
    def _uniform_tl(key, ids):
        """``uniform_noise`` for one row key and a block of token ids."""
        h = _mix32_tl(_mix32_tl(key ^ ids.to(tl.uint32)) ^ key)
        return ((h >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23

    @triton.jit
    def _sample_kernel(
        logits_ptr, mask_ptr, temperature_ptr, seeds_ptr, positions_ptr, tokens_ptr, logprobs_ptr,
        stride_row, vocab,
        HAS_MASK: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        temperature = tl.load(temperature_ptr + row)
        greedy = temperature == 0.0
        t = tl.where(greedy, 1.0, temperature)
        key = _row_key_tl(tl.load(seeds_ptr + row), tl.load(positions_ptr + row))

        best_score = tl.full([], float("-inf"), tl.float32)
        best_token = tl.full([], 0, tl.int64)
        best_scaled = tl.full([], 0.0, tl.float32)
        run_max = tl.full([], float("-inf"), tl.float32)  # online logsumexp of scaled
        run_sum = tl.full([], 0.0, tl.float32)
        for start in range(0, vocab, BLOCK_V):
            ids = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
            ok = ids < vocab
            x = tl.load(logits_ptr + row * stride_row + ids, mask=ok, other=float("-inf")).to(tl.float32)
            scaled = tl.math.div_rn(x, t)  # [BLOCK_V]; IEEE like torch (plain / is approximate)
            u = _uniform_tl(key, ids)  # [BLOCK_V]
            noise = tl.where(greedy, 0.0, -tl.log(-tl.log(u)))
            score = tl.where(ok, scaled + noise, float("-inf"))
            if HAS_MASK:
                allowed = tl.load(mask_ptr + row * vocab + ids, mask=ok, other=0)
                score = tl.where(allowed != 0, score, float("-inf"))
            block_best = tl.max(score, axis=0)
            block_arg = tl.argmax(score, axis=0)  # ties to the lowest id
            # Strictly greater: an earlier block keeps ties, so ties go to the lowest id overall.
            better = block_best > best_score
            best_scaled = tl.where(better, tl.sum(tl.where(ids == start + block_arg, scaled, 0.0), axis=0),
                                   best_scaled)
            best_token = tl.where(better, (start + block_arg).to(tl.int64), best_token)
            best_score = tl.where(better, block_best, best_score)
            # Masked (-inf) logits may fill whole blocks: keep exp() away from -inf - -inf.
            new_max = tl.maximum(run_max, tl.max(scaled, axis=0))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe_max) + tl.sum(tl.exp(scaled - safe_max), axis=0)
            run_max = new_max
        tl.store(tokens_ptr + row, best_token)
        tl.store(logprobs_ptr + row, best_scaled - run_max - tl.log(run_sum))
