"""The CPU worker's compiled kernels, C++17 behind flat C ABIs, built by `make install`
(services/rollout/drafter/native/build.py --target gumbel|attention): the sampler's RNG
(gumbel.cpp -> libgumbel.so, loaded by kernels/gumbel_native.py) and the paged
attention's passes over the KV cache (attention.cpp -> libattention.so, loaded by
kernels/paged_attention_native.py).

Both are found and loaded the same way (``Library``), and both take rows (sequences,
sampler rows) that a caller may split across threads: a ctypes call releases the GIL, so
``run_split`` runs the parts in a persistent pool."""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

HERE = Path(__file__).resolve().parent
BUNDLE_LIB = HERE.parents[1] / ".gpu-bundle" / "lib"  # make gpu-bundle's copies (the GPU machine)


class Library:
    """One compiled library: where it is ($``env``, else the build of `make install` in this
    folder, else the GPU bundle's copy), its ABI version checked and its functions typed,
    loaded once per path. ``load`` returns None, after one line on ``log`` (``failure``,
    formatted with the path and the error, naming `make install`), when it is missing or
    does not load: the caller then runs its PyTorch reference."""

    def __init__(self, filename: str, env: str, abi_version: int, abi_symbol: str,
                 functions: dict[str, tuple[type, list]], log: logging.Logger, failure: str):
        self.built, self.bundled, self.env = HERE / filename, BUNDLE_LIB / filename, env
        self.abi_version, self.abi_symbol, self.functions = abi_version, abi_symbol, functions
        self.log, self.failure = log, failure
        self._loaded: dict[str, ctypes.CDLL | None] = {}
        self._default: dict[str | None, str] = {}  # load()'s path by $env's value, found once

    def path(self) -> Path:
        if os.environ.get(self.env):
            return Path(os.environ[self.env])
        return self.bundled if not self.built.exists() and self.bundled.exists() else self.built

    def load(self, path: str | Path | None = None) -> ctypes.CDLL | None:
        if path is None:  # the kernels' own calls, several a step: no file-system check after the first
            env = os.environ.get(self.env)
            key = self._default.get(env)
            if key is None:
                key = self._default[env] = str(self.path())
        else:
            key = str(path)
        if key not in self._loaded:
            self._loaded[key] = self._open(key)
        return self._loaded[key]

    def _open(self, path: str) -> ctypes.CDLL | None:
        try:
            lib = ctypes.CDLL(path)
            abi = getattr(lib, self.abi_symbol)
            abi.restype, abi.argtypes = ctypes.c_int, []
            if abi() != self.abi_version:
                raise OSError(f"ABI version {abi()}, expected {self.abi_version}")
            for name, (restype, argtypes) in self.functions.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
        except (OSError, AttributeError) as exc:
            self.log.warning(self.failure, path, exc)
            return None
        return lib


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
