"""The short seeded fault campaign (benchmarks/chaos.py; the long one runs in make bench):
real processes killed and restarted, weights pushed and bad input sent while two
trainers run steps. Nothing lost, nothing duplicated, nothing hung, every sample's
tokens those of the fault-free run."""

from __future__ import annotations

import json

import pytest

from benchmarks.chaos import main
from benchmarks.chaos_faults import KINDS

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


def test_short_campaign_loses_duplicates_and_hangs_nothing(tmp_path):
    result = main(["--seed", "1", "--faults", str(len(KINDS)), "--steps", "6", "--no-fair-share", "--soak-steps", "0",
                   "--out", str(tmp_path)])
    assert json.loads((tmp_path / "chaos.json").read_text())["seed"] == 1
    assert result["num_faults"] == len(KINDS) and set(result["faults"]) == set(KINDS)
    assert result["steps"] >= 6 and result["samples"] > 0
    assert (result["lost"], result["duplicated"], result["hangs"]) == (0, 0, 0)
    assert result["identical_share"] == 1.0
    assert not result["errors"] and not result["bad_input_mismatch"]
    assert result["memory_bounded"]
    assert result["reregister_s"] is not None  # the fleet came back after each scheduler kill
