"""benchmarks.drafter_ab: two builds of the drafter's core in one replay, taking turns by
step, each call timed per side, their drafts compared."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from benchmarks import drafter_ab as AB
from benchmarks import drafter_replay as R
from services.rollout.drafter import DrafterConfig
from services.rollout.drafter.compiled import CompiledDrafter, library_path
from services.rollout.drafter.native import build as native_build


class Recorder:
    """A drafter that logs which side each call reached, in order."""

    def __init__(self, name: str, log: list, drafts: list | None = None) -> None:
        self.name, self.log, self.drafts = name, log, drafts

    def __getattr__(self, method):
        def call(*args, **kw):
            self.log.append((self.name, method))
            return self.drafts if method == "propose" else None
        return call


def test_the_sides_take_turns_step_by_step_and_both_get_every_call():
    log: list = []
    p = AB.Paired(Recorder("a", log, [[1]]), Recorder("b", log, [[1]]))
    for _ in range(3):
        assert p.propose(["r"], [4]) == [[1]]
        p.commit_step(["r"], [1], [1], [5], [1])
    p.start_request("r", "p", [1, 2])
    order = [side for side, method in log if method in ("propose", "commit_step")]
    assert order == ["a", "b", "a", "b", "b", "a", "b", "a", "a", "b", "a", "b"]
    assert sorted(side for side, method in log if method == "start_request") == ["a", "b"]
    assert len(p.propose_ns) == len(p.commit_ns) == 3 and p.different == 0
    assert all(n == 1 and a >= 0 and b >= 0 for n, a, b in p.propose_ns)


def test_different_drafts_are_counted_and_a_drafts_go_on():
    traces = R.synthetic_traces(num_prompts=2, num_epochs=2, num_samples=4)
    made = {}

    def make():
        made["p"] = AB.Paired(CompiledDrafter(DrafterConfig(max_draft_len=8)),
                              CompiledDrafter(DrafterConfig(max_draft_len=2)))
        return made["p"]

    row = R.replay(traces, make, R.stop_token(traces))
    alone = R.replay(traces, lambda: CompiledDrafter(DrafterConfig(max_draft_len=8)), R.stop_token(traces))
    assert made["p"].different > 0
    for key in ("mean_accepted_per_step", "mean_accepted_drafts_per_step"):  # the replay went on with A's drafts
        assert row[key] == alone[key]


def test_compare_pairs_the_steps_it_selects():
    pairs = [(20, 2000, 4000), (20, 1000, 2000), (1, 500, 500)]
    c = AB.compare(pairs, lambda n: n >= 16, np.random.default_rng(0))
    assert c["steps"] == 2 and c["median_step_ratio"] == 2.0 and c["total_ratio"] == 2.0
    assert c["total_ratio_95"] == [2.0, 2.0]
    assert (c["a_p50"], c["b_p50"]) == pytest.approx((0.075, 0.15))  # µs per sequence: 0.1 and 0.05 for A
    assert AB.compare(pairs, lambda n: n >= 100, np.random.default_rng(0)) is None


def test_one_library_against_itself_drafts_the_same_and_writes_its_files(tmp_path):
    lib = str(library_path())
    summary = AB.main(["--a", lib, "--b", lib, "--traces", "benchmarks/data/tiny_grpo_service.npz",
                       "--out", str(tmp_path)])
    (result,) = summary["results"]
    assert result["steps_with_different_drafts"] == 0 and result["num_steps"] > 100
    for key in ("propose_16plus", "commit_16plus", "step_100plus", "one_seq_step"):
        c = result[key]
        assert c["steps"] > 0 and 0 < c["total_ratio_95"][0] <= c["total_ratio"] <= c["total_ratio_95"][1]
    written = json.loads((tmp_path / "drafter_ab.json").read_text())
    assert written["a"] == written["b"] == lib and written["git_commit"]
    assert "median step B/A" in (tmp_path / "drafter_ab.md").read_text()


def test_a_revision_is_built_from_its_own_sources_with_the_release_flags(tmp_path):
    """(Compiling is `make install`'s test; here: the sources and the command.)"""
    source = AB.rev_sources("HEAD", tmp_path / "src")
    for name in ("histo.cpp", "histo.h"):
        committed = subprocess.run(["git", "show", f"HEAD:{AB.CORE}/{name}"], check=True, capture_output=True).stdout
        assert (tmp_path / "src" / name).read_bytes() == committed
    argv = AB.release_command(source, tmp_path / "lib.so")
    release = native_build.command(tmp_path / "lib.so")
    assert argv[0] == release[0] and sorted(argv) == sorted(release[:-1] + [str(source)])


@pytest.mark.parametrize("argv,says", [
    (["--a", "{missing}", "--b", "{lib}"], "--a {missing}: the compiled drafter library {missing} is missing"),
    (["--a", "{lib}", "--b", "{garbage}"], "--b {garbage}: the compiled drafter library {garbage} does not load"),
    (["--a-rev", "no-such-rev", "--b", "{lib}"], "--a-rev no-such-rev: git show failed: fatal: invalid object"),
    (["--a", "{lib}", "--b", "{lib}", "--traces", "{missing}"], "--traces: no such file: {missing}"),
])
def test_a_library_revision_or_trace_set_that_is_not_there_is_one_usage_line(argv, says, tmp_path, capsys):
    """Each was a traceback (a DrafterLibraryError advising RHYMERL_WORKER_DRAFTER, a
    CalledProcessError of git show, a FileNotFoundError), some after a build had run."""
    (tmp_path / "garbage.so").write_text("not a library")
    names = {"lib": str(library_path()), "missing": str(tmp_path / "missing"), "garbage": str(tmp_path / "garbage.so")}
    with pytest.raises(SystemExit) as exit_:
        AB.main([a.format(**names) for a in argv] + ["--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert f"error: {says.format(**names)}" in capsys.readouterr().err.replace("\n", " ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("module", ["drafter_bench", "drafter_host"])
def test_the_other_drafter_benchmarks_name_a_missing_trace_set_too(module, tmp_path, capsys):
    main = __import__(f"benchmarks.{module}", fromlist=["main"]).main
    with pytest.raises(SystemExit) as exit_:
        main(["--traces", str(tmp_path / "missing.npz"), "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert f"error: --traces: no such file: {tmp_path / 'missing.npz'}" in capsys.readouterr().err
