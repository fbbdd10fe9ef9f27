"""scheduler_bench --extra reads the draft acceptance the drafter bench measured. If these
fail, the speculative section cannot start (the drafter bench's keys moved) or simulates
a different acceptance than the one measured."""

import json
from pathlib import Path

import pytest

from benchmarks.scheduler_bench import trace_acceptance
from services.scheduler.simulator import SpecConfig

ROOT = Path(__file__).resolve().parents[2]


def test_trace_acceptance_reads_the_committed_drafter_results():
    spec, source = trace_acceptance(str(ROOT / "benchmarks" / "results" / "drafter.json"))
    measured = json.loads((ROOT / "benchmarks" / "results" / "drafter.json").read_text())
    (length, accepted), = measured["rhymerl_mean_accepted_fixed"].items()
    assert spec.max_draft == int(length)
    # the simulated workers accept, per verify at that fixed length, what the drafter did
    assert sum(spec.alpha ** i for i in range(spec.max_draft + 1)) == pytest.approx(1.0 + accepted, rel=1e-9)
    assert f"{accepted:.2f} draft tokens accepted per verify at {length} drafts" in source


def test_trace_acceptance_takes_the_best_fixed_draft_length(tmp_path):
    """Several fixed lengths measured: the one that accepted most per verify is simulated."""
    path = tmp_path / "drafter.json"
    path.write_text(json.dumps({"rhymerl_mean_accepted_fixed": {"8": 1.2, "16": 1.5, "32": 1.4},
                                "traces": "t.npz", "git_commit": "abc"}))
    spec, _ = trace_acceptance(str(path))
    assert spec == SpecConfig(alpha=SpecConfig.alpha_from_mean_accepted(2.5, 16), max_draft=16)
