"""Fixtures of the chart tests: Helm's renderer and the Kubernetes validator, once per session."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # chart_render sits next to the tests

from chart_render import make_renderer, make_validator  # noqa: E402


@pytest.fixture(scope="session")
def render():
    return make_renderer()


@pytest.fixture(scope="session")
def validate():
    return make_validator()
