"""benchmarks.drafter_feed: both ways hand the whole stream to the drafter; the deferred
way spreads it over steps at the per-step budget, the other puts it in one gap."""

from __future__ import annotations

import pytest
import torch

from benchmarks import drafter_feed as F
from benchmarks.engine_host import tiny_model


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    model = tiny_model()
    return model, F.stream(["benchmarks/data/tiny_grpo_service.npz"], model.config.vocab_size, 6000)


def test_the_stream_lands_at_once_between_steps_or_over_steps_when_deferred(setup):
    model, responses = setup
    tokens = sum(map(len, responses))
    assert 5000 < tokens <= 6000 and all(0 < t < model.config.vocab_size for r in responses for t in r)
    between = F.run(model, "between", responses, batch=4, new_tokens=48, chunk_tokens=500, cost_per_step=1000)
    deferred = F.run(model, "deferred", responses, batch=4, new_tokens=48, chunk_tokens=500, cost_per_step=1000)
    assert between["steps_to_land"] == 1
    # about two 500-token chunks behind each forward: at least tokens / 1000 steps
    assert deferred["steps_to_land"] >= tokens // 1000
    for row in (between, deferred):
        assert row["global_tokens"] >= tokens // 2 and row["feed_exposed"] is not None
        assert row["exposed_max"] >= row["feed_exposed"] > 0
