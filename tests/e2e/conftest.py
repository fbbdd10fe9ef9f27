"""Fixtures of the end-to-end tests: one tiny model and one in-process cluster per module."""

from __future__ import annotations

import pytest

from tests.e2e.cluster import Cluster, save_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cluster(model_dir, redis_url):
    c = Cluster(model_dir=model_dir, redis_url=redis_url).start()
    yield c
    c.stop()
