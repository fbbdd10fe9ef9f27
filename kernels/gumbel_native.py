"""The CPU sampler's Gumbel noise with its integer hashing in C++ (native/gumbel.cpp).

On a CPU worker the sampler's RNG was most of the step: ``sampling.gumbel_noise`` hashes
every (row, token) four times through ``_mix32`` in int64 PyTorch ops (about 70 passes
over a [rows, vocab] tensor), 74% of a SmolLM2 worker's time at vocabulary 49,152 and 256
rows. Here the hashes and the uniforms come from one C loop per row, and only the
logarithms run in PyTorch, on blocks of rows small enough to stay in cache:

    noise = gumbel_noise(seeds, positions, vocab_size)   # None: the library is missing

For rows without truncation (the T=1 rollout's rows) the sampler need not compute every
token's logarithms at all: ``sample_screened`` bounds each token's score from a table
(the noise is monotone in the uniform it comes from), keeps the few tokens whose upper
bound reaches the best lower bound, and computes only their noise exactly: the same
token as the full argmax, bit for bit.

The result is ``sampling.gumbel_noise``'s, bit for bit (tests/kernels/test_gumbel_native.py):
the C code reproduces the reference's integer hash and its float32 ``_unit`` step for
step, and the logarithms are PyTorch's own, applied to the same float32 values. So the
tokens a CPU worker samples do not depend on whether the library was built; without it
the sampler runs the PyTorch reference (slower), and the first call logs one line
naming `make install`, which builds it.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

from kernels.native import Library, even_bounds, run_split

ABI_VERSION = 3
BLOCK_ELEMENTS = 1 << 19  # rows per block: about 2 MB of float32, cache-sized

log = logging.getLogger(__name__)
_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_LIBRARY = Library(
    "libgumbel.so", "RHYMERL_GUMBEL_LIBRARY", ABI_VERSION, "rhg_abi_version",
    {"rhg_signed_units": (ctypes.c_int, [_p, _p, _i64, _i64, _p]),
     "rhg_screen": (ctypes.c_int, [_p, _p, _i64, _i64, _p, _i64, _p, _i64, _i64, _p, _p, _p, _p])},
    log, "the CPU sampler's compiled RNG %s does not load (%s): sampling uses the slower PyTorch reference; "
         "`make install` builds it")
LIBRARY, BUNDLED, LIBRARY_ENV = _LIBRARY.built, _LIBRARY.bundled, _LIBRARY.env  # LIBRARY_ENV: another build of it


def library_path() -> Path:
    """$RHYMERL_GUMBEL_LIBRARY, else the build of `make install`, else the GPU bundle's copy."""
    return _LIBRARY.path()


def load_library(path: str | Path | None = None) -> ctypes.CDLL | None:
    """The library (``library_path()`` unless given) with its functions typed, or None
    (logged once per path) when it is missing or does not load."""
    return _LIBRARY.load(path)


def available() -> bool:
    return load_library() is not None


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int,
                 block_elements: int = BLOCK_ELEMENTS) -> torch.Tensor | None:
    """``sampling.gumbel_noise`` for CPU tensors, bit for bit; None without the library.

    Args:
        seeds, positions: [n] int64 on the CPU.
        vocab_size: the row length.
        block_elements: about how many values each block of rows holds (any value gives
            the same noise).
    Returns:
        [n, vocab_size] float32.
    """
    from kernels.sampling import _ROW_SALT, _ROW_SALT_2, _row_key

    lib = load_library()
    if lib is None:
        return None
    seeds, positions = seeds.long(), positions.long()
    n = seeds.shape[0]
    # [n] int64 holding uint32 values, handed over as they are (no host read: a CPU tensor's memory)
    key_hi = _row_key(seeds, positions, _ROW_SALT).contiguous()
    key_lo = _row_key(seeds, positions, _ROW_SALT_2).contiguous()
    noise = torch.empty(n, vocab_size, dtype=torch.float32)  # [n, vocab]
    rows = max(1, block_elements // max(1, vocab_size))
    units = torch.empty(min(rows, n), vocab_size, dtype=torch.float32)  # [rows, vocab], reused
    for start in range(0, n, rows):
        end = min(n, start + rows)
        block = units[: end - start]
        rc = lib.rhg_signed_units(key_hi[start:].data_ptr(), key_lo[start:].data_ptr(), end - start,
                                  vocab_size, block.data_ptr())
        if rc != 0:
            raise ValueError(f"vocab_size {vocab_size} or a row key is out of the compiled RNG's range")
        noise[start:end] = _noise_of_units(block)
    return noise


BUCKET_SHIFT = 16  # a signed unit's float bits >> this: its bucket (1/128 of an octave)
NUM_BUCKETS = (0x3F000000 >> BUCKET_SHIFT) + 1  # units lie in (0, 1/2]
MAX_CANDIDATES = 16  # per row; a row with more is sampled in full
BOUND_MARGIN = 1e-4  # widens every bound: the logarithms' rounding is not quite monotone
PARALLEL_MIN_ELEMENTS = 1 << 20  # rows x vocabulary from which the screening is split across threads


def _noise_of_units(units: torch.Tensor) -> torch.Tensor:
    """The reference's noise from signed units (+U where U < 1/2, -(1 - U) elsewhere: the
    reference's two branches, ``sampling.gumbel_from_bits`` step for step)."""
    from kernels.sampling import _neg_log1p_neg

    low_half = units > 0
    w = units.abs()
    return torch.neg(torch.log(torch.where(low_half, -torch.log(w), _neg_log1p_neg(w))))


@cache
def bounds_table() -> torch.Tensor:
    """[2, NUM_BUCKETS, 2] float32: per branch (U < 1/2, U >= 1/2) and bucket of signed
    units, a lower and an upper bound of the noise of every unit in it: the reference's
    noise at the bucket's two ends (monotone in between), widened by BOUND_MARGIN."""
    first = torch.arange(NUM_BUCKETS, dtype=torch.int64) << BUCKET_SHIFT
    last = torch.clamp(first + (1 << BUCKET_SHIFT) - 1, max=0x3F000000)  # 1/2: the largest unit
    ends = torch.stack((first, last), dim=1).to(torch.int32).view(torch.float32)  # [buckets, 2] units
    ends = torch.where(ends > 0, ends, torch.finfo(torch.float32).tiny)  # bucket 0 starts at +0
    table = torch.empty(2, NUM_BUCKETS, 2, dtype=torch.float32)
    for branch, sign in enumerate((1.0, -1.0)):
        g = _noise_of_units(ends * sign)  # [buckets, 2]
        lo, hi = torch.minimum(g[:, 0], g[:, 1]), torch.maximum(g[:, 0], g[:, 1])
        table[branch, :, 0] = lo - BOUND_MARGIN * (1 + lo.abs())
        table[branch, :, 1] = hi + BOUND_MARGIN * (1 + hi.abs())
    return table.contiguous()


def sample_screened(scaled: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """argmax(scaled + gumbel_noise(seeds, positions)) per row, bit for bit the reference's
    token, with the noise computed exactly for a few candidates per row only; None
    without the library.

    Args:
        scaled: [n, vocab] float32 on the CPU, the rows' logits / temperature.
        seeds, positions: [n] int64.
    Returns:
        [n] int64 tokens.
    """
    from kernels.sampling import _ROW_SALT, _ROW_SALT_2, _row_key

    lib = load_library()
    if lib is None:
        return None
    scaled = scaled.float().contiguous()
    n, vocab = scaled.shape
    seeds, positions = seeds.long(), positions.long()
    key_hi = _row_key(seeds, positions, _ROW_SALT).contiguous()
    key_lo = _row_key(seeds, positions, _ROW_SALT_2).contiguous()
    table = bounds_table()
    cand = torch.zeros(n, MAX_CANDIDATES, dtype=torch.int64)
    units = torch.full((n, MAX_CANDIDATES), 0.25, dtype=torch.float32)  # unused entries: any finite noise
    count = torch.empty(n, dtype=torch.int64)
    bounds = even_bounds(n, torch.get_num_threads() if n * vocab >= PARALLEL_MIN_ELEMENTS else 1)
    scratch = torch.empty(len(bounds) - 1, vocab, dtype=torch.float32)  # one row per thread

    def screen(part: int, first: int, end: int) -> int:
        return lib.rhg_screen(key_hi[first:].data_ptr(), key_lo[first:].data_ptr(), end - first, vocab,
                              scaled[first:].data_ptr(), vocab, table.data_ptr(), NUM_BUCKETS, MAX_CANDIDATES,
                              scratch[part].data_ptr(), cand[first:].data_ptr(), units[first:].data_ptr(),
                              count[first:].data_ptr())

    if any(run_split(screen, bounds)):
        raise ValueError(f"vocab_size {vocab} or a row key is out of the compiled RNG's range")
    scores = scaled.gather(1, cand) + _noise_of_units(units.view(-1)).view(n, MAX_CANDIDATES)  # the reference's sum
    scores = scores.masked_fill(torch.arange(MAX_CANDIDATES)[None, :] >= count[:, None], float("-inf"))
    tokens = cand.gather(1, scores.argmax(dim=1, keepdim=True)).squeeze(1)  # the first best: the lowest id
    full = (count < 0).nonzero().flatten()
    if full.numel():  # too many candidates (near-ties everywhere, or NaN): those rows in full
        noise = gumbel_noise(seeds[full], positions[full], vocab)
        tokens[full] = (scaled[full] + noise).argmax(dim=1)
    return tokens
