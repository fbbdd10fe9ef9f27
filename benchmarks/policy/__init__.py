"""The policy rhymerl is measured on: a small Llama/Qwen-style model trained here from
scratch on the synthetic reasoning task of `clients/python/examples/reasoning_task.py`.

- tokenizer.py: the task's closed-vocabulary tokenizer, in Hugging Face `tokenizers` format.
- train_sft.py: supervised warm-up on worked answers; writes an HF-loadable checkpoint.
- local_client.py: an in-process stand-in for the rhymerl SDK client (samples with the HF
  model directly), for testing the example GRPO trainer and recording CPU traces.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "clients" / "python" / "examples"


def load_example(name: str) -> ModuleType:
    """Imports `clients/python/examples/<name>.py` once, under its plain name.

    The examples are standalone scripts shipped with the SDK, not a package; the example
    trainer imports its sibling `reasoning_task` by that same name, so both share one module.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, EXAMPLES_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
