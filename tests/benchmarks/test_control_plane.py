"""The control-plane benchmark's machinery end to end, tiny: the real scheduler process,
fake workers in two processes over loopback gRPC, one trainer, the health prober. Checks
counts, never timings: every sample delivered once, every chunk of divided rollout
answered once by the fleet, and each row holding every field the results promise."""

import json

import pytest

from benchmarks import control_plane

ISSUE_FIELDS = {"workers", "samples", "trainers", "chunks_per_s", "samples_per_s", "sched_cpu_ms_per_1k",
                "peak_rss_mb", "health_p99_ms", "marked_unhealthy"}


@pytest.mark.slow
def test_benchmark_row_counts_every_sample_and_chunk(tmp_path):
    # 3 workers, 2 per process; 2 trainers, each 6 prompts x 4 samples, the step log on;
    # 10-token responses in chunks of 4 tokens: each sample is 3 chunks (4 + 4 + 2), so
    # the fleet answers 3 x 48 items.
    result = control_plane.main([
        "--workers", "3", "--samples", "48", "--trainers", "2", "--step-log", "on", "--policies", "rhymerl",
        "--n", "4", "--slots", "8",
        "--response-tokens", "10", "--per-process", "2", "--settle-s", "0", "--step-timeout-s", "120",
        "--scheduler-env", "RHYMERL_SCHEDULER_CHUNK_TOKENS=4", "--idle-workers", "2", "--idle-s", "0.5",
        "--out", str(tmp_path), "--out-name", "cp"])
    row, = result["rows"]
    assert row["error"] == "" and row["summary"]
    assert (row["trainers"], row["step_log"], row["step_log_on"]) == (2, True, True)
    assert (row["delivered"], row["lost"], row["duplicated"], row["aborted"]) == (48, 0, 0, 0)
    assert row["chunks"] == 3 * 48 and row["chunks_rerun"] == 0
    assert 1 <= row["batches"] <= row["chunks"]
    assert row["marked_unhealthy"] == row["marked_unhealthy_in_step"] == row["workers_dropped"] == 0
    assert row["health_failures"] == row["health_main_failures"] == 0 and row["health_checks"] >= 1
    assert row["health_not_serving"] == row["health_main_not_serving"] == 0  # the fleet could serve throughout
    idle, = result["idle"]  # heartbeats alone: registered workers are never polled
    assert (idle["workers"], idle["stats_polls"], idle["marked_unhealthy"], idle["health_failures"]) == (2, 0, 0, 0)
    assert idle["health_not_serving"] == 0 and idle["heartbeat_s"] == 5.0 and idle["sched_cpu_s"] >= 0
    assert row["sched_cpu_s"] >= 0 and row["peak_rss_mb"] > 0
    assert ISSUE_FIELDS <= set(row)
    written = json.loads((tmp_path / "cp.json").read_text())
    assert written["rows"] == json.loads(json.dumps(result["rows"]))
    assert {"device", "commit", "command"} <= set(written)
    assert "| rhymerl | 3 | 48 | 2 | True |" in (tmp_path / "cp.md").read_text()

