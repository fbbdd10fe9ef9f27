"""The CPU worker's compiled kernels, C++17 behind flat C ABIs, built by `make install`
(services/rollout/drafter/native/build.py --target gumbel|attention): the sampler's RNG
(gumbel.cpp -> libgumbel.so, loaded by kernels/gumbel_native.py) and the paged
attention's passes over the KV cache (attention.cpp -> libattention.so, loaded by
kernels/paged_attention_native.py).

Both take rows (sequences, sampler rows) that a caller may split across threads: a
ctypes call releases the GIL, so ``run_split`` runs the parts in a persistent pool."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache


@cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rhymerl-native")


def run_split(call: Callable[[int, int, int], int], bounds: list[int]) -> list[int]:
    """``call(part, first, end)`` for each part [bounds[i], bounds[i + 1]), in the pool's
    threads when there are several parts (each call must touch only its own rows and
    scratch); returns their results in order."""
    parts = [(i, a, b) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    if len(parts) == 1:
        return [call(*parts[0])]
    return list(_pool(len(parts)).map(lambda p: call(*p), parts))


def even_bounds(n: int, parts: int) -> list[int]:
    """[0, ..., n] cut into ``parts`` (at most n) nearly equal ranges."""
    parts = max(1, min(parts, n))
    return [n * i // parts for i in range(parts + 1)]
