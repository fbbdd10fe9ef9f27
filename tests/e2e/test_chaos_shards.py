"""The chaos campaign against two scheduler shards behind the step router (benchmarks/chaos.py
--shards 2), as real processes: a shard's scheduler killed (kill -9, then SIGTERM) while
it runs a sub-step, and the router killed (kill -9, then SIGTERM) while it routes a step,
each restarted after a moment, while two trainers run steps through the router. Nothing
lost, nothing duplicated, nothing hung, every sample's tokens those of the fault-free run.

The four faults are the first four of SHARDED_KINDS (a schedule shorter than the kinds
takes them in order); every wait in the campaign is on state (a step running, workers
registered, the router using the shard again), bounded, never a sleep before a check."""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import main
from benchmarks.chaos_faults import SHARDED_KINDS

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

KILLS = ["kill9_shard", "sigterm_shard", "kill9_router", "sigterm_router"]


def test_sharded_campaign_survives_a_shard_and_the_router_killed_mid_step(tmp_path):
    assert SHARDED_KINDS[:len(KILLS)] == KILLS
    result = main(["--shards", "2", "--seed", "1", "--faults", str(len(KILLS)), "--steps", "4",
                   "--step-deadline-s", "120", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "chaos_shards.json").read_text())["shards"] == 2
    assert result["faults"] == {kind: 1 for kind in KILLS}
    # each kill found a step running: on the shard (a sub-step of its own), on the router
    assert (result["shard_kills_mid_step"], result["router_kills_mid_step"]) == (2, 2)
    assert result["steps"] >= 4 and result["samples"] > 0
    assert (result["lost"], result["duplicated"], result["hangs"]) == (0, 0, 0), (
        result["errors"], result["duplicates"])
    assert result["identical_share"] == 1.0, result["mismatches"]
    assert not result["errors"] and result["memory_bounded"]
    assert result["reregister_s"] is not None and result["router_back_s"] is not None
