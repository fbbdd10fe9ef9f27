"""The tiny policy's checkpoint (models/tiny by default): trained on first use by
whatever needs it (`make run`, the benchmarks, the dashboard snapshot)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ensure_model(model_dir: str) -> None:
    """Trains the tiny policy (deterministic, ~3 minutes on 2 cores) if it is not there yet.
    A process of its own: training sets torch's threads and seeds for itself."""
    if (Path(model_dir) / "config.json").exists():
        return
    print(f"training the tiny policy into {model_dir} (first run only)...", flush=True)
    subprocess.run([sys.executable, "-m", "benchmarks.tiny_llm.train_sft", "--preset", "tiny", "--out", model_dir,
                    "--seed", "0"], cwd=ROOT, check=True)
