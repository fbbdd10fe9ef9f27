"""Builds vLLM's "suffix" speculative method (ArcticInference's suffix decoding) for the
drafter benchmark, outside the tracked tree.

vLLM's `method="suffix"` imports `arctic_inference.suffix_decoding.SuffixDecodingCache`:
a Python wrapper over a C++ suffix tree (`_C`, nanobind). This script fetches the PyPI
sdist of `arctic-inference` with pip, compiles only `csrc/suffix_decoding` with cmake +
nanobind (from PyPI; about a minute on one core) and lays out a minimal importable
package in the cache folder:

    <cache>/arctic_inference/__init__.py                   (empty: the rest needs vLLM)
    <cache>/arctic_inference/suffix_decoding/{__init__,cache}.py   (from the sdist)
    <cache>/arctic_inference/suffix_decoding/_C.<ext>      (built here)

Nothing of it is committed; `benchmarks.peers.suffix_decoding.load_peer()` imports it.

    python -m benchmarks.peers.build_suffix_decoding [--cache DIR] [--force]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

ARCTIC_VERSION = "0.3.0"  # the sdist pinned: results name the peer's version
NANOBIND_VERSION = "2.9.2"  # what the sdist itself builds with (its pyproject)
DEFAULT_CACHE = Path(os.environ.get("RHYMERL_PEER_CACHE", Path.home() / ".cache" / "rhymerl" / "peers"))


def package_dir(cache: Path = DEFAULT_CACHE) -> Path:
    """The folder to put on sys.path to import the built peer."""
    return cache / f"arctic-inference-{ARCTIC_VERSION}"


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def build(cache: Path = DEFAULT_CACHE, force: bool = False) -> Path:
    """Fetches, compiles and lays out the peer; returns its package folder.

    Raises:
        subprocess.CalledProcessError: pip, cmake or the compiler failed.
    """
    out = package_dir(cache)
    target = out / "arctic_inference" / "suffix_decoding"
    ext = sysconfig.get_config_var("EXT_SUFFIX")
    if (target / f"_C{ext}").exists() and not force:
        print(f"peer already built: {out}")
        return out
    with tempfile.TemporaryDirectory(prefix="rhymerl-peer-") as tmp:
        work = Path(tmp)
        # The sdist's metadata step imports torch: build without isolation, in this venv.
        _run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
              "--no-build-isolation", f"arctic-inference=={ARCTIC_VERSION}", "-d", str(work)])
        _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(work / "deps"),
              f"nanobind=={NANOBIND_VERSION}"])
        sdist = next(work.glob("arctic_inference-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(work / "src", filter="data")
        root = next((work / "src").iterdir())
        env = {**os.environ, "PYTHONPATH": str(work / "deps")}
        build_dir = work / "build"
        _run(["cmake", "-S", str(root / "csrc" / "suffix_decoding"), "-B", str(build_dir),
              "-DCMAKE_BUILD_TYPE=Release", f"-DPython_EXECUTABLE={sys.executable}"], env=env)
        _run(["cmake", "--build", str(build_dir), "-j", "2"], env=env)
        built = next(build_dir.glob("_C*.so"))
        if out.exists():
            shutil.rmtree(out)
        target.mkdir(parents=True)
        (out / "arctic_inference" / "__init__.py").write_text("")
        for name in ("__init__.py", "cache.py"):
            shutil.copy(root / "arctic_inference" / "suffix_decoding" / name, target / name)
        shutil.copy(built, target / f"_C{ext}")
    print(f"peer built: {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="cache folder (outside the repo)")
    parser.add_argument("--force", action="store_true", help="rebuild even if built")
    args = parser.parse_args()
    build(args.cache, args.force)


if __name__ == "__main__":
    main()
