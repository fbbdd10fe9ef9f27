"""benchmarks/drafter_callgrind.py's reading of a callgrind profile: the counts docs/drafter.md
reports for rhd_step and rhd_commit must be every instruction and miss of those calls."""

import shutil

import pytest

from benchmarks.drafter_callgrind import report

# An entry point's body is split over the source files its code was inlined from (one line of
# callgrind_annotate each), zeros appear both as "0" (a cost written) and "." (none), and other
# functions are not counted; a step's commits come through rhd_commit or rhd_commit_bound.
PROFILE = """version: 1
creator: test
events: Ir ILmr DLmr DLmw
fl=/src/histo.cpp
fn=int (anonymous namespace)::guarded<rhd_step::{lambda(Drafter&)#1}>(void*)
1 1000 0 10 0
fl=/usr/include/c++/12/bits/stl_vector.h
fn=int (anonymous namespace)::guarded<rhd_step::{lambda(Drafter&)#1}>(void*)
2 500 0 0 5
fl=/src/histo.cpp
fn=int (anonymous namespace)::guarded<rhd_commit::{lambda(Drafter&)#1}>(void*)
3 700 1 2 3
fn=int (anonymous namespace)::guarded<rhd_commit_bound::{lambda(Drafter&)#1}>(void*)
6 300 0 1 1
fn=int (anonymous namespace)::guarded<rhd_stop::{lambda(Drafter&)#1}>(void*)
4 9000 7 7 7
fn=main
5 40 2
"""


@pytest.mark.skipif(shutil.which("callgrind_annotate") is None, reason="valgrind's callgrind_annotate is not installed")
def test_report_sums_each_entry_point_over_its_source_files(tmp_path):
    path = tmp_path / "callgrind.out"
    path.write_text(PROFILE)
    assert report(str(path)) == {"rhd_step": {"Ir": 1500, "LLmiss": 15}, "rhd_commit": {"Ir": 1000, "LLmiss": 8}}
