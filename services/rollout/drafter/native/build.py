"""Builds the project's compiled hot paths into shared libraries, with g++ (or $CXX).

    python3 services/rollout/drafter/native/build.py [--target histo|gumbel|attention] [--out PATH] [--sanitize]

Targets: `histo`, the compiled drafter core (histo.cpp, the default); `gumbel`, the CPU
sampler's RNG (kernels/native/gumbel.cpp, loaded by kernels/gumbel_native.py); and
`attention`, the CPU paged attention's passes over the KV cache (kernels/native/attention.cpp,
loaded by kernels/paged_attention_native.py).

Release build: -O2, libstdc++ and libgcc linked statically and no libm, so the library
needs no glibc symbol newer than 2.17 and one build loads on any Python (ctypes, a flat C
ABI). `--sanitize`: AddressSanitizer + UndefinedBehaviorSanitizer (for the tests), loaded
with the sanitizer runtime preloaded. Standard library only: `make install` runs it
before the virtual environment has anything.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from typing import NamedTuple
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCES = [HERE / "histo.cpp"]
HEADERS = [HERE / "histo.h"]
LIBRARY = HERE / "libhisto.so"
SANITIZED = HERE / "libhisto_asan.so"
KERNELS = HERE.parents[3] / "kernels" / "native"


class Target(NamedTuple):  # (a NamedTuple: deploy/gpu/bundle.py loads this file by path)
    sources: list[Path]
    headers: list[Path]
    library: Path
    sanitized: Path
    optimize: str = "-O2"


TARGETS = {
    "histo": Target(SOURCES, HEADERS, LIBRARY, SANITIZED),
    # -O3: its one loop is integer hashing that only pays once vectorised
    "gumbel": Target([KERNELS / "gumbel.cpp"], [], KERNELS / "libgumbel.so", KERNELS / "libgumbel_asan.so", "-O3"),
    # -O3: its dot products and weighted sums only pay once vectorised
    "attention": Target([KERNELS / "attention.cpp"], [], KERNELS / "libattention.so", KERNELS / "libattention_asan.so",
                        "-O3"),
}

COMMON = ["-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", "-ffp-contract=off", "-fno-exceptions", "-fno-rtti",
          "-fno-threadsafe-statics", "-Wall", "-Wextra"]
RELEASE = ["-static-libstdc++", "-static-libgcc", "-Wl,--as-needed", "-Wl,-z,defs", "-s"]
SANITIZE = ["-DRHD_SANITIZE", "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def command(out: Path, sanitize: bool = False, target: str = "histo") -> list[str]:
    spec = TARGETS[target]
    flags = COMMON + (SANITIZE if sanitize else [spec.optimize, *RELEASE])
    return [*shlex.split(compiler()), *flags, "-o", str(out), *map(str, spec.sources)]


def build(out: Path | None = None, sanitize: bool = False, force: bool = False, target: str = "histo") -> Path:
    """Builds the target's library unless it is newer than its sources; returns its path."""
    spec = TARGETS[target]
    out = Path(out) if out is not None else (spec.sanitized if sanitize else spec.library)
    newest = max(p.stat().st_mtime for p in spec.sources + spec.headers + [Path(__file__)])
    if not force and out.exists() and out.stat().st_mtime >= newest:
        return out
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    subprocess.run(command(tmp, sanitize, target), check=True)
    os.replace(tmp, out)  # atomic: a process loading it never sees half a file
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="histo")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--sanitize", action="store_true")
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    try:
        print(build(args.out, args.sanitize, args.force, args.target))
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(f"building the compiled {args.target} library failed ({exc}); it needs a C++17 compiler (g++ or $CXX)")


if __name__ == "__main__":
    main()
