"""benchmarks/spec_sweep.py's rows and targets on the CPU (a random micro policy, 16 tokens).

On the CPU (float32) speculation gives plain decoding's tokens, so the sweep's two failure
modes seen on the H200 (2026-11-26) are simulated here: speculative runs that end earlier
than plain (the speedup must be per generated token, not plain seconds over run seconds),
and an oracle whose drafts stop matching the run (its row must say it did not reach its
cut instead of giving a verdict on its target).
"""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks import spec_sweep
from benchmarks.engine_grpo import TRACES
from benchmarks.tiny_llm import train_sft
from services.common.traces import read_traces
from services.rollout.loader import init_random_model

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def micro():
    preset = dataclasses.replace(train_sft.PRESETS["tiny"], hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    return init_random_model(train_sft.model_config(preset), seed=0), read_traces(TRACES)


def sweep(micro, batches=(1,)) -> list[dict]:
    model, records = micro
    return spec_sweep.sweep_shape(spec_sweep.TARGET_SHAPE, model, records, batches, spec_sweep.ORACLE_CUTS,
                                  MAX_TOKENS, "cpu", log=lambda row: None)


def plain_of(rows: list[dict], row: dict) -> dict:
    return next(r for r in rows if r["drafter"] == "plain" and r["batch"] == row["batch"]
                and r.get("stop") == row.get("stop"))


def by_target(rows: list[dict]) -> dict:
    return {(t["drafter"], t["batch"]): t for t in spec_sweep.targets(rows)}


def test_oracle_rows_do_equal_work_and_reach_their_cut(micro):
    """Plain and the oracle generate exactly max tokens per sequence, the same tokens (float32),
    so the per-token speedup and the wall ratio are one figure; every oracle reaches its cut;
    history (linear, and draft trees at the tail's batches) is compared with plain stopping
    at EOS; each target at batch 1 gets a verdict."""
    rows = sweep(micro, batches=(1, 4))
    assert {(r["stop"], r["drafter"]) for r in rows} == {
        ("EOS", "plain"), ("EOS", "history"), ("EOS", "history-tree"), ("max", "plain"), ("max", "oracle 1.5"),
        ("max", "oracle 2.5")}
    for r in rows:
        assert r["identical_share"] == 1.0, r
        if r["stop"] == "max":
            assert r["tokens"] == r["batch"] * MAX_TOKENS and r["tokens_vs_plain"] == 1.0
            assert r["speedup_vs_plain"] == pytest.approx(r["wall_ratio_vs_plain"], rel=1e-9)
        if r["cut"] is not None:
            assert r["cut_reached"] >= spec_sweep.CUT_REACHED, r
    targets = by_target(rows)
    for drafter in spec_sweep.TARGETS:
        assert targets[(drafter, 1)]["met"] is not None and targets[(drafter, 1)]["reason"] is None
        assert targets[(drafter, 16)]["measured"] is None and "not measured" in targets[(drafter, 16)]["reason"]


def test_a_run_that_ends_earlier_than_plain_is_compared_per_token(micro, monkeypatch):
    """Defect 1 of the H200 sweep: speculative runs stopped at EOS after far fewer tokens than
    plain, and 'speedup' (plain s / run s) read 6.46x for 1.2x the tokens/s. Here every
    speculative run's samples are cut to half: the speedup must be the ratio of tokens/s,
    the wall ratio kept beside it, and a target on unequal work gets no verdict."""
    real = spec_sweep.run_engine

    def ending_early(engine, reqs):
        outputs, seconds = real(engine, reqs)
        if engine.speculative:
            outputs = {k: dataclasses.replace(o, token_ids=o.token_ids[:len(o.token_ids) // 2])
                       for k, o in outputs.items()}
        return outputs, seconds

    monkeypatch.setattr(spec_sweep, "run_engine", ending_early)
    rows = sweep(micro)
    for r in rows:
        if r["drafter"] == "plain":
            continue
        plain = plain_of(rows, r)
        assert r["speedup_vs_plain"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"], rel=1e-9), r
        assert r["wall_ratio_vs_plain"] == pytest.approx(plain["seconds"] / r["seconds"], rel=1e-9), r
        assert r["tokens_vs_plain"] == pytest.approx(0.5)
    for drafter in spec_sweep.TARGETS:
        target = by_target(rows)[(drafter, 1)]
        assert target["met"] is None and "not the same work" in target["reason"], target


def test_an_oracle_that_misses_its_cut_is_flagged_not_judged(micro, monkeypatch):
    """Defect 2: on the H200 the runs left plain's tokens, every oracle draft after that was
    rejected, and rows cut to 1.5-4 accepted per verify measured 0.15-0.46 with a met / not
    met verdict. Here the oracle drafts wrong tokens after the first two (a run that left
    plain's path): its rows must show the achieved share of the cut and its targets say they
    are not measured, with no verdict."""

    class Diverged(spec_sweep.CutOracleDrafter):
        def __init__(self, continuations, per_verify):
            super().__init__({k: v[:2] + [(t + 1) % 40 + 3 for t in v[2:]] for k, v in continuations.items()},
                             per_verify)

    monkeypatch.setattr(spec_sweep, "CutOracleDrafter", Diverged)
    rows = sweep(micro)
    targets = by_target(rows)
    for drafter in ("oracle 1.5", "oracle 2.5"):
        assert targets[(drafter, 1)]["met"] is None, targets[(drafter, 1)]
        assert "does not measure its target" in targets[(drafter, 1)]["reason"]
    assert targets[("history", 1)]["met"] is not None  # history's row is untouched
    oracles = [r for r in rows if r["drafter"].startswith("oracle")]
    assert len(oracles) == len(spec_sweep.ORACLE_CUTS)
    for r in oracles:
        assert r["cut_reached"] == pytest.approx(r["accepted_per_verify"] / r["cut"])
        assert r["cut_reached"] < spec_sweep.CUT_REACHED, r
    text = spec_sweep.markdown(dict(device="cpu", commit="x", command="c", setting="s", rows=rows,
                                    targets=spec_sweep.targets(rows), forward_check={}))
    assert text.count("no verdict: does not measure its target") == 2
