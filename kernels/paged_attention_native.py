"""The CPU paged attention for decode and verify steps, its two passes over the KV cache
compiled (native/attention.cpp); the softmax between them is PyTorch's.

``paged_attention_reference`` gathers each sequence's context out of the block pool into
dense padded K and V (two copies of every cached row per layer per step) before its
matmuls read them again. At a real model's shapes that is most of a CPU decode step:
a SmolLM2-135M worker at 256 sequences of about 600 tokens moves some 7 GB of KV per
step through those copies, and attention took about half of its time. Here

    out = paged_attention_native(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)

reads each cached row in place through the block table, once per query row that sees
it: ``rpa_scores`` writes each query row's scaled dot products with its visible keys
(-inf past them), ``torch.softmax`` turns them into probabilities, and ``rpa_values``
sums the visible values weighted by them. It returns None (the caller runs the
reference) where it does not apply: the library missing (logged once, naming `make
install`), tensors not float32 on the CPU, a draft tree's mask, or a query longer than
``MAX_QUERY`` rows (a prefill chunk, compute-bound, where the reference's matmuls are the
better tool). Each query row's result depends on that row's own query, context and
cache alone (a fixed summation order per row, whatever the batch), and equals the
reference's up to float32 rounding (tests/kernels/test_paged_attention_native.py).

Large steps are split by sequences across ``torch.get_num_threads()`` threads (each call
releases the GIL); small ones run in the calling thread.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch

from kernels.native import Library, run_split

ABI_VERSION = 1
MAX_QUERY = 64  # query rows per sequence up to which this path serves (decode, verify)
PARALLEL_MIN_WORK = 1 << 22  # multiply-adds per pass (query rows x context x heads x head size) from which
#                              a step is split across threads (about a millisecond of one thread)

log = logging.getLogger(__name__)
_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_LIBRARY = Library(
    "libattention.so", "RHYMERL_ATTENTION_LIBRARY", ABI_VERSION, "rpa_abi_version",
    {"rpa_scores": (_i64, [_p, _p, _p, _p, _p, _p, _i64, _i64, ctypes.c_float, _p]),
     "rpa_values": (_i64, [_p, _p, _p, _p, _p, _p, _i64, _i64, _p])},
    log, "the CPU paged attention's compiled passes %s do not load (%s): attention uses the slower PyTorch "
         "reference; `make install` builds them")
LIBRARY, BUNDLED, LIBRARY_ENV = _LIBRARY.built, _LIBRARY.bundled, _LIBRARY.env  # LIBRARY_ENV: another build of it


def library_path() -> Path:
    """$RHYMERL_ATTENTION_LIBRARY, else the build of `make install`, else the GPU bundle's copy."""
    return _LIBRARY.path()


def load_library(path: str | Path | None = None) -> ctypes.CDLL | None:
    """The library (``library_path()`` unless given) with its functions typed, or None
    (logged once per path) when it is missing or does not load."""
    return _LIBRARY.load(path)


def available() -> bool:
    return load_library() is not None


def applies(q: torch.Tensor, k_cache: torch.Tensor, max_query_len: int | None, tree_mask) -> bool:
    """Whether this path serves the step (else the caller runs the reference)."""
    return (tree_mask is None and q.device.type == "cpu" and q.dtype == torch.float32
            and k_cache.dtype == torch.float32 and (max_query_len is None or max_query_len <= MAX_QUERY))


def paged_attention_native(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
                           max_query_len: int | None = None, tree_mask=None,
                           num_threads: int | None = None) -> torch.Tensor | None:
    """``paged_attention_reference``'s result (up to float32 rounding), or None where this
    path does not apply (see the module's docstring). ``num_threads``: how many threads a
    large step is split across (default ``torch.get_num_threads()``)."""
    if not applies(q, k_cache, max_query_len, tree_mask):
        return None
    lib = load_library()
    if lib is None:
        return None
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"paged attention: q {tuple(q.shape)} must be [tokens, heads, head_dim] and k_cache "
                         f"{tuple(k_cache.shape)} [blocks, block_size, kv_heads, head_dim]")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    if tuple(k_cache.shape[3:]) != (head_dim,) or v_cache.shape != k_cache.shape or num_heads % num_kv_heads:
        raise ValueError(f"paged attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} do not fit together")
    num_seqs = seq_lens.shape[0]
    if (block_tables.dim() != 2 or block_tables.shape[0] < num_seqs or query_start_loc.dim() != 1
            or query_start_loc.shape[0] < num_seqs + 1):
        raise ValueError(f"paged attention: block_tables {tuple(block_tables.shape)} and query_start_loc "
                         f"{tuple(query_start_loc.shape)} must cover the {num_seqs} sequences of seq_lens")
    out = torch.zeros_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    lens = seq_lens.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    if max_query_len is None and int((starts[1:] - starts[:-1]).max()) > MAX_QUERY:
        return None
    tables = block_tables.to(torch.int32).contiguous()
    width = max(int(lens.max()), 0)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    shape = torch.tensor([num_tokens, num_heads, num_kv_heads, head_dim, num_blocks, block_size, tables.shape[1],
                          width], dtype=torch.int64)
    scores = torch.empty(num_tokens, num_heads, width, dtype=torch.float32)
    bounds = _split(starts, num_seqs, width * num_heads * head_dim, num_threads or torch.get_num_threads())
    common = (tables.data_ptr(), lens.data_ptr(), starts.data_ptr())
    c_scale = ctypes.c_float(scale)
    _check(run_split(lambda part, a, b: lib.rpa_scores(shape.data_ptr(), q.data_ptr(), k_cache.data_ptr(), *common,
                                                        a, b, c_scale, scores.data_ptr()), bounds))
    probs = torch.softmax(scores, dim=-1)
    _check(run_split(lambda part, a, b: lib.rpa_values(shape.data_ptr(), probs.data_ptr(), v_cache.data_ptr(),
                                                        *common, a, b, out.data_ptr()), bounds))
    return out


def _check(results: list[int]) -> None:
    """Raises ValueError naming what the library refused (its calls' return codes)."""
    bad = next((r for r in results if r), 0)
    if bad < 0:
        raise ValueError("paged attention: bad dimensions")
    if bad:
        raise ValueError(f"paged attention: sequence {bad - 1}'s seq_lens, query_start_loc or block_tables are "
                         "out of range")


def _split(starts: torch.Tensor, num_seqs: int, work_per_row: int, threads: int) -> list[int]:
    """Bounds of sequence ranges of about equal query rows, one range per thread for a large step."""
    rows = int(starts[num_seqs]) - int(starts[0])
    if threads <= 1 or num_seqs < 2 or rows * work_per_row < PARALLEL_MIN_WORK:
        return [0, num_seqs]
    threads = min(threads, num_seqs)
    cuts = torch.searchsorted(starts[:num_seqs + 1].to(torch.int64),
                              torch.linspace(int(starts[0]), int(starts[num_seqs]), threads + 1)[1:-1].to(torch.int64))
    return [0, *sorted(set(int(c) for c in cuts.tolist()) - {0, num_seqs}), num_seqs]
