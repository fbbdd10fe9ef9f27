"""Fixtures shared by the whole suite: a real redis-server, and CPU-friendly torch."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton decorates functions for its CPU interpreter (tests/kernels) only if this is set
    # before triton is first imported, its own library included: any test module that
    # imports the engine at collection would otherwise import it first.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from services.common.redis_server import EmbeddedRedis  # noqa: E402


@pytest.fixture(scope="session")
def redis_url():
    """A real redis-server on a free loopback port, for the whole session."""
    with EmbeddedRedis() as server:
        yield server.url


@pytest.fixture
def clean_redis(redis_url):
    """The session's Redis, flushed before the test."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushall()
    client.close()
    return redis_url


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    if has_cuda or os.environ.get("RHYMERL_GPU_TESTS_ON_CPU") == "1":  # tests/gpu/conftest.py: a dry run
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
