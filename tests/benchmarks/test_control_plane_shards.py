"""The shards benchmark's own accounting, on a tiny fleet: two scheduler shards behind the
real router, one scheduler direct; every sample delivered once, each process measured."""

from __future__ import annotations

import json

import pytest

from benchmarks import control_plane_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_rows_count_every_sample_once_and_measure_each_process(tmp_path):
    result = control_plane_shards.main([
        "--workers", "4", "--samples", "64", "--shards", "2", "--n", "4", "--slots", "4", "--per-process", "2",
        "--settle-s", "0", "--step-timeout-s", "120", "--out", str(tmp_path), "--out-name", "cps"])
    direct, sharded = result["rows"]
    for row in (direct, sharded):
        assert (row["delivered"], row["lost"], row["duplicated"], row["error"]) == (64, 0, 0, "")
        assert row["summary"]
    assert not direct["router"] and direct["shards"] == 1 and direct["router_cpu_s"] is None
    assert sharded["router"] and sharded["shards"] == 2
    assert sharded["router_cpu_s"] >= 0 and len(sharded["shard_cpu_s"]) == len(sharded["shard_peak_rss_mb"]) == 2
    assert all(rss > 0 for rss in sharded["shard_peak_rss_mb"]) and sharded["router_peak_rss_mb"] > 0
    written = json.loads((tmp_path / "cps.json").read_text())
    assert written["commit"] and written["device"] and "control_plane_shards" in written["command"]
    assert "2 shards + router" in (tmp_path / "cps.md").read_text()
