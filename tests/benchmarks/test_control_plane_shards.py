"""The shards benchmark's own accounting, on a tiny fleet: two scheduler shards behind the
real router, one scheduler direct; every sample delivered once, each process measured;
its rows written into the control-plane results' "shards" key, which the single-scheduler
benchmark keeps when it rewrites the file."""

from __future__ import annotations

import json

import pytest

from benchmarks import control_plane, control_plane_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def single_scheduler_result(marker: str) -> dict:
    return {"rows": [], "idle": [], "note": marker, "command": "python -m benchmarks.control_plane", "commit": "c",
            "device": "CPU"}


def test_rows_count_every_sample_once_and_measure_each_process(tmp_path):
    (tmp_path / "cps.json").write_text(json.dumps(single_scheduler_result("the single-scheduler run")))
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
    assert written["note"] == "the single-scheduler run"  # the rest of the file kept
    shards = written["shards"]
    assert shards["rows"] == json.loads(json.dumps(result["rows"]))
    assert shards["commit"] and shards["device"] and "control_plane_shards" in shards["command"]
    assert "2 shards + router" in (tmp_path / "cps.md").read_text()
    control_plane_shards.write_into(shards, tmp_path, "cps")  # a second run replaces the section
    assert (tmp_path / "cps.md").read_text().count(control_plane_shards.SECTION) == 1
    # the single-scheduler benchmark rewrites the file: its new run, the shards' rows kept
    control_plane.write(single_scheduler_result("a new single-scheduler run"), tmp_path, "cps")
    rewritten = json.loads((tmp_path / "cps.json").read_text())
    assert rewritten["note"] == "a new single-scheduler run" and rewritten["shards"] == shards
    assert "2 shards + router" in (tmp_path / "cps.md").read_text()
