"""Where a benchmark result came from: the commit and the CPU, for benchmarks/results/."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit(*paths: str) -> str:
    """$RHYMERL_COMMIT when set (deploy/gpu/launch.py sets it from the bundle on the GPU
    machine, whose copy of the tree may hold a stale .git); else HEAD's short hash, with
    "-dirty" when the work tree (or just ``paths``, if given) differs from it, leaving out
    benchmarks/results (what an earlier benchmark of the same session wrote is not code);
    outside a git checkout, "uncommitted"."""
    if os.environ.get("RHYMERL_COMMIT"):
        return os.environ["RHYMERL_COMMIT"]
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=False, cwd=REPO)
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        commit = git("rev-parse", "--short", "HEAD")
        if not commit:
            return os.environ.get("RHYMERL_COMMIT", "uncommitted")
        changed = git("status", "--porcelain", "--", *(paths or (".",)), ":(exclude)benchmarks/results")
        return commit + ("-dirty" if changed else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("RHYMERL_COMMIT", "uncommitted")


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
