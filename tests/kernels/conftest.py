"""Run the Triton kernels through Triton's CPU interpreter when there is no GPU.

The interpreter is chosen when a kernel is decorated (at import), so TRITON_INTERPRET
is set here, before the test modules import ``kernels``; modules imported earlier by
other test folders are reloaded so their kernels are re-decorated."""

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for name in ("kernels.paged_attention", "kernels.sampling", "kernels.matmul", "kernels.rms_norm",
                 "kernels.fused", "kernels.rotary"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """With a GPU, these tests run the real kernels on it: they belong to the GPU tier
    (`make test-gpu` selects -m gpu) as well as to the suite."""
    if torch.cuda.is_available():
        here = Path(__file__).resolve().parent
        for item in items:
            if here in Path(str(item.fspath)).resolve().parents:
                item.add_marker(pytest.mark.gpu)
