"""Where a benchmark result came from: the commit and the CPU, for benchmarks/results/."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def git_commit(*paths: str) -> str:
    """HEAD's short hash, with "-dirty" when the work tree (or just ``paths``, if given)
    differs from it; "uncommitted" outside a git checkout."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=False, cwd=REPO)
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        commit = git("rev-parse", "--short", "HEAD")
        if not commit:
            return "uncommitted"
        return commit + ("-dirty" if git("status", "--porcelain", "--", *paths) else "")
    except (OSError, subprocess.SubprocessError):
        return "uncommitted"


def cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
