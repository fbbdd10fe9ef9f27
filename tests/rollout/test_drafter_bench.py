"""The drafter benchmark's replay, on a tiny synthetic trace set and through the trace
file format. If these fail, benchmarks/results/drafter.md cannot be trusted."""

from __future__ import annotations

import numpy as np

from benchmarks import drafter_bench
from benchmarks.traces import TraceRecord, write_traces


def test_replay_counts_and_history_beats_ngram():
    """Each verify step commits 1 + accepted tokens, so the tokens committed equal the
    trace lengths; with history + siblings the mean accepted length beats n-gram."""
    traces = drafter_bench.synthetic_traces(num_prompts=2, num_epochs=3, num_samples=3, seed=1)
    stop = drafter_bench._stop_token(traces)
    assert stop == drafter_bench.EOS
    ngram = drafter_bench.replay(traces, drafter_bench.Config("ngram/8", "ngram", 8), stop)
    full = drafter_bench.replay(traces, drafter_bench.Config("all/8", "all", 8), stop)
    adaptive = drafter_bench.replay(traces, drafter_bench.Config("all/a", "all", None), stop)
    total = sum(len(t.token_ids) for t in traces)
    assert ngram["num_tokens"] == full["num_tokens"] == adaptive["num_tokens"] == total
    assert 1.0 <= ngram["mean_accepted_per_step"] < full["mean_accepted_per_step"]
    assert adaptive["mean_accepted_per_step"] > 1.0
    assert 0 < full["memory_tokens_max"] <= 65536


def test_main_reads_a_trace_file_and_writes_results(tmp_path):
    """--traces PATH in the benchmarks.traces format is replayed and the .md/.json
    results are written."""
    synthetic = drafter_bench.synthetic_traces(num_prompts=1, num_epochs=2, num_samples=2, seed=2)
    records = [TraceRecord(t.prompt_id, t.epoch, t.sample_index, t.epoch,
                           np.array(t.prompt_token_ids, np.int32), np.array(t.token_ids, np.int32),
                           np.zeros(len(t.token_ids), np.float32), t.reward) for t in synthetic]
    path = tmp_path / "traces.npz"
    write_traces(path, records)
    summary = drafter_bench.main(["--traces", str(path), "--out", str(tmp_path)])
    assert summary["num_traces"] == 4 and summary["traces"] == str(path)
    assert (tmp_path / "drafter.md").exists() and (tmp_path / "drafter.json").exists()
    # The results format.
    rows = {r["config"]: r for r in summary["rows"]}
    assert summary["ngram_mean_accepted"] == max(
        rows[f"ngram/{k}"]["mean_accepted_drafts_per_step"] for k in (4, 8, 16))
    assert summary["rhymerl_mean_accepted"] == max(
        rows[f"all/{k}"]["mean_accepted_drafts_per_step"] for k in (4, 8, 16, "adaptive"))
    assert set(summary["rhymerl_mean_accepted_fixed"]) == {"4", "8", "16"}
    for row in rows.values():  # bonus token excluded: committed - 1 per step, except the
        # steps whose accepted draft ended the response (no bonus token after the end)
        committed = row["mean_accepted_per_step"]
        assert committed - 1 - 1e-9 <= row["mean_accepted_drafts_per_step"] < committed
    assert 0 < summary["drafting_us_p50"] <= summary["drafting_us_p99"]
    assert "--traces" in summary["command"]
