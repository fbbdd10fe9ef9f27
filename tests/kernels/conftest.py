"""Run the Triton kernels through Triton's CPU interpreter when there is no GPU.

The interpreter is chosen when a kernel is decorated (at import), so TRITON_INTERPRET
is set here, before the test modules import ``kernels``; modules imported earlier by
other test folders are reloaded so their kernels are re-decorated."""

import importlib
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for name in ("kernels.paged_attention", "kernels.sampling"):
        if name in sys.modules:
            importlib.reload(sys.modules[name])
