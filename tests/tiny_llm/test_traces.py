"""Trace files and the cross-epoch similarity report computed from them."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks import trace_similarity
from services.common.traces import TraceRecord, read_traces, write_traces


def _record(prompt_id, epoch, index, tokens, reward=0.0, version=None):
    return TraceRecord(
        prompt_id=prompt_id,
        epoch=epoch,
        sample_index=index,
        policy_version=epoch if version is None else version,
        prompt_token_ids=np.array([1, len(prompt_id)], dtype=np.int32),
        token_ids=np.array(tokens, dtype=np.int32),
        logprobs=-np.arange(len(tokens), dtype=np.float32) / 10,
        reward=reward,
    )


def test_write_read_round_trip(tmp_path):
    """Every field comes back exactly, in order, including empty responses."""
    records = [
        _record("gcd-84-36", 0, 0, [5, 6, 7], reward=1.0),
        _record("gcd-84-36", 0, 1, []),
        _record("sort-3-1-2", 1, 0, list(range(300)), reward=0.25, version=7),
    ]
    path = tmp_path / "t.npz"
    write_traces(path, records)
    back = read_traces(path)
    assert len(back) == len(records)
    for a, b in zip(records, back):
        assert (a.prompt_id, a.epoch, a.sample_index, a.policy_version) == (
            b.prompt_id, b.epoch, b.sample_index, b.policy_version,
        )
        assert b.reward == pytest.approx(a.reward)
        for field in ("prompt_token_ids", "token_ids", "logprobs"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
        assert b.token_ids.dtype == np.int32 and b.logprobs.dtype == np.float32
    write_traces(tmp_path / "empty.npz", [])
    assert read_traces(tmp_path / "empty.npz") == []


def test_write_rejects_mismatched_logprobs(tmp_path):
    record = _record("p", 0, 0, [1, 2])
    record.logprobs = record.logprobs[:1]
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        write_traces(tmp_path / "bad.npz", [record])


def test_similarity_on_a_hand_made_example(tmp_path):
    """Epoch 1 repeats epoch 0 except one changed token; lengths keep their order."""
    records = [
        _record("a", 0, 0, [1, 2, 3, 4]),
        _record("a", 0, 1, [1, 2, 3, 4]),
        _record("b", 0, 0, [7, 8, 9, 9, 9, 9, 9, 9]),
        _record("c", 0, 0, [5, 5]),
        # prompt a: identical -> 4/4 predicted
        _record("a", 1, 0, [1, 2, 3, 4]),
        # prompt b: token 3 changed (9 -> 6): after "7 8 6", "6" never occurred -> no
        # prediction for the next token either; then "6 9" backs off to "9" -> 9s predicted
        _record("b", 1, 0, [7, 8, 6, 9, 9, 9]),
        # prompt d: no epoch-0 history -> not counted
        _record("d", 1, 0, [1, 1, 1]),
    ]
    rows = trace_similarity.trace_similarity(records)
    assert len(rows) == 1
    row = rows[0]
    assert row["epoch"] == 1 and row["num_prompts"] == 2 and row["num_responses"] == 2
    # b: 7 hit, 8 hit, 6 miss, 9 miss (no context after "6"), 9 hit, 9 hit -> 4/6
    assert row["num_tokens"] == 10
    assert row["token_match_share"] == pytest.approx((4 + 4) / 10)
    assert row["mean_response_match_share"] == pytest.approx((1.0 + 4 / 6) / 2)
    assert row["token_match_share_with_siblings"] == pytest.approx(0.8)  # no prompt has two samples
    assert row["length_pearson"] == pytest.approx(1.0)  # (4, 8) -> (4, 6)
    assert row["length_spearman"] == pytest.approx(1.0)

    path = tmp_path / "traces.npz"
    write_traces(path, records)
    trace_similarity.main([str(path), "--out-dir", str(tmp_path / "out")])
    report = json.loads((tmp_path / "out" / "similarity.json").read_text())
    # The results format: epochs (epoch, token_match_share, length_spearman),
    # max_over_median_length, command.
    (epoch,) = report["epochs"]
    assert epoch["epoch"] == 1 and epoch["token_match_share"] == pytest.approx(0.8)
    assert epoch["length_spearman"] == pytest.approx(1.0)
    # lengths over all epochs: 4, 4, 8, 2, 4, 6, 3 -> median 4, max 8
    assert report["max_over_median_length"] == pytest.approx(2.0)
    assert report["files"][str(path)]["epochs"] == report["epochs"]
    assert report["commit"] and report["device"] and "trace_similarity" in report["command"]
    assert "| 1 | 2 | 2 |" in (tmp_path / "out" / "similarity.md").read_text()


def test_siblings_add_to_the_history():
    """The second sample may also match the first one of its own epoch."""
    records = [
        _record("a", 0, 0, [4, 2, 3]),
        _record("a", 1, 0, [1, 5, 6, 7]),  # nothing in the history predicts it
        _record("a", 1, 1, [1, 5, 6, 7]),  # with sibling 0: all 4 (START->1 wins the 1-vs-4 tie)
    ]
    (row,) = trace_similarity.trace_similarity(records)
    assert row["token_match_share"] == 0.0
    assert row["token_match_share_with_siblings"] == pytest.approx(4 / 8)


def test_rank_correlation_handles_ties_and_constants():
    assert trace_similarity.spearman([1, 2, 2, 3], [10, 20, 20, 30]) == pytest.approx(1.0)
    assert trace_similarity.spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(trace_similarity.pearson([1, 1, 1], [1, 2, 3]))
