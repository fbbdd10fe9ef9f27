"""The GPU tier (`make test-gpu`): every test here is marked `gpu` and skips without CUDA.

RHYMERL_GPU_TESTS_ON_CPU=1 runs the same assertions on the CPU paths (reference
kernels, no CUDA graphs): a dry run of the tier's own logic for when no GPU is lent, e.g.
    RHYMERL_GPU_TESTS_ON_CPU=1 python -m pytest -q tests/gpu
"""

import os

import pytest

ON_CPU = os.environ.get("RHYMERL_GPU_TESTS_ON_CPU") == "1"


@pytest.fixture(scope="session")
def device() -> str:
    return "cpu" if ON_CPU else "cuda"
