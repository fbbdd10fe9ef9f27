"""The SDK's example scripts (clients/python/examples), which the tiny LLM is trained
against (the reasoning task) and driven by (the GRPO trainer)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "clients" / "python" / "examples"


def load_example(name: str):
    """Imports clients/python/examples/<name>.py under its plain name. The examples are
    standalone scripts shipped with the SDK, not a package; the example trainer imports
    its sibling ``reasoning_task`` by that name, so both share one module."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    return importlib.import_module(name)
