"""The CPU sampler's Gumbel noise with its integer hashing in C++ (native/gumbel.cpp).

On a CPU worker the sampler's RNG was most of the step: ``sampling.gumbel_noise`` hashes
every (row, token) four times through ``_mix32`` in int64 PyTorch ops (about 70 passes
over a [rows, vocab] tensor), 74% of a SmolLM2 worker's time at vocabulary 49,152 and 256
rows. Here the hashes and the uniforms come from one C loop per row, and only the
logarithms run in PyTorch, on blocks of rows small enough to stay in cache:

    noise = gumbel_noise(seeds, positions, vocab_size)   # None: the library is missing

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
import os
from functools import cache
from pathlib import Path

import torch

LIBRARY = Path(__file__).resolve().parent / "native" / "libgumbel.so"
BUNDLED = Path(__file__).resolve().parents[1] / ".gpu-bundle" / "lib" / "libgumbel.so"  # make gpu-bundle
LIBRARY_ENV = "RHYMERL_GUMBEL_LIBRARY"  # another build of it
ABI_VERSION = 2
BLOCK_ELEMENTS = 1 << 19  # rows per block: about 2 MB of float32, cache-sized

log = logging.getLogger(__name__)


def library_path() -> Path:
    """$RHYMERL_GUMBEL_LIBRARY, else the build of `make install`, else the GPU bundle's copy."""
    if os.environ.get(LIBRARY_ENV):
        return Path(os.environ[LIBRARY_ENV])
    return BUNDLED if not LIBRARY.exists() and BUNDLED.exists() else LIBRARY


def load_library(path: str | Path | None = None) -> ctypes.CDLL | None:
    """The library (``library_path()`` unless given) with its function typed, or None
    (logged once per path) when it is missing or does not load."""
    return _load(str(path if path is not None else library_path()))


@cache
def _load(path: str) -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(path)
        lib.rhg_abi_version.restype, lib.rhg_abi_version.argtypes = ctypes.c_int, []
        if lib.rhg_abi_version() != ABI_VERSION:
            raise OSError(f"ABI version {lib.rhg_abi_version()}, expected {ABI_VERSION}")
        fn = lib.rhg_signed_units
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    except (OSError, AttributeError) as exc:
        log.warning("the CPU sampler's compiled RNG %s does not load (%s): sampling uses the slower PyTorch "
                    "reference; `make install` builds it", path, exc)
        return None
    return lib


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
    from kernels.sampling import _ROW_SALT, _ROW_SALT_2, _neg_log1p_neg, _row_key

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
        # block = +U where U < 1/2, -(1 - U) elsewhere: the reference's two branches
        low_half = block > 0
        w = block.abs()
        torch.neg(torch.log(torch.where(low_half, -torch.log(w), _neg_log1p_neg(w))), out=noise[start:end])
    return noise
