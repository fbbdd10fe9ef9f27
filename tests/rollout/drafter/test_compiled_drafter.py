"""The compiled drafter (services/rollout/drafter/compiled.py over native/histo.cpp) against
the Python HistoDrafter, its reference.

If these fail: the compiled core drafts otherwise than the reference (a walk, a tie, a
back-off, the budget's cut, an eviction, a global flip, a resumed chunk differs), bad input
crashes or corrupts the process instead of raising, the library needs a newer glibc than
the GPU machine's, or it has memory errors / undefined behaviour (the sanitizer run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks import drafter_replay as R
from kernels.gumbel_native import LIBRARY as GUMBEL_LIBRARY
from kernels.paged_attention_native import LIBRARY as ATTENTION_LIBRARY
from services.rollout.drafter import DrafterConfig, HistoDrafter, UnknownRequestError
from services.rollout.drafter.compiled import (
    LIBRARY,
    CompiledDrafter,
    DrafterFullError,
    DrafterLibraryError,
    load_library,
)
from services.rollout.drafter.budget import gain_threshold
from services.rollout.drafter.native import build
from services.rollout.engine.cost_model import CostModel
from tests.rollout.drafter import fuzz_ops, parity_ops

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module", autouse=True)
def _library():
    build.build()  # up to date after `make install`; else built here (seconds)


# -- parity ---------------------------------------------------------------------------

@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_lifecycles_draft_as_the_reference(seed):
    """Random prompts, histories (ages, rewards), siblings, global responses, resumed
    chunks, aborts, releases, evictions at tiny bounds and random settings: every draft,
    counter and memory figure equals the reference's."""
    parity_ops.compare(seed, lambda c: CompiledDrafter(c, max_slots=128))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_states_with_many_continuations_draft_as_the_reference(seed):
    """Siblings drafting together, step after step, through contexts with tens of
    continuations whose weights each step's commits change: the core's kept scans of such
    states (ScanCache) never outlive a change of their index."""
    parity_ops.compare_wide(seed, lambda c: CompiledDrafter(c, max_slots=16))


class _Logged:
    """Passes calls through and keeps propose's (and propose_trees's) answers."""

    def __init__(self, drafter) -> None:
        self.drafter, self.drafts = drafter, []

    def __getattr__(self, name):
        method = getattr(self.drafter, name)
        if name not in ("propose", "propose_trees"):
            return method

        def propose(*args, **kwargs):
            out = method(*args, **kwargs)
            self.drafts.append(out)
            return out
        return propose


@pytest.mark.parametrize("path", ["benchmarks/data/tiny_grpo_service.npz", "benchmarks/data/tiny_grpo_service_t07.npz"])
def test_committed_traces_draft_as_the_reference(path):
    """The lockstep replay of a committed trace set (its first epochs, a few prompts, the
    product config with the cost threshold at a full batch): the same drafts, step by step."""
    traces = R.load_traces(str(ROOT / path))
    prompts = sorted({t.prompt_id for t in traces})[:6]
    traces = [t for t in traces if t.prompt_id in prompts and t.epoch < 4]
    stop = R.stop_token(traces)
    config = DrafterConfig(cost_model=R.COST)
    rows, logs = {}, {}
    for name, cls in (("python", HistoDrafter), ("compiled", CompiledDrafter)):
        logged = _Logged(cls(config))
        rows[name] = R.replay(traces, lambda logged=logged: logged, stop, name, num_seqs=64)
        logs[name] = logged.drafts
    assert sum(len(d) for step in logs["python"] for d in step) > 100  # it did draft
    assert logs["compiled"] == logs["python"]
    for key in ("num_tokens", "num_verify_steps", "mean_accepted_drafts_per_step", "draft_tokens_per_step",
                "memory_tokens_max", "global_tokens_max"):
        assert rows["compiled"][key] == rows["python"][key], key


@pytest.mark.parametrize("path", ["benchmarks/data/tiny_grpo_service.npz", "benchmarks/data/tiny_grpo_service_t07.npz"])
def test_committed_traces_draft_the_reference_trees(path):
    """The same replay with draft trees on, priced at a tail batch (8 sequences: trees at
    every step, tree_min_gain's floor and the cost threshold): the same trees (tokens and
    parents), step by step, and the same accepted paths' counts."""
    traces = R.load_traces(str(ROOT / path))
    prompts = sorted({t.prompt_id for t in traces})[:4]
    traces = [t for t in traces if t.prompt_id in prompts and t.epoch < 3]
    stop = R.stop_token(traces)
    config = DrafterConfig(cost_model=R.COST, tree=True)
    rows, logs = {}, {}
    for name, cls in (("python", HistoDrafter), ("compiled", CompiledDrafter)):
        logged = _Logged(cls(config))
        rows[name] = R.replay(traces, lambda logged=logged: logged, stop, name, num_seqs=8)
        logs[name] = logged.drafts
    branched = [parents for step in logs["python"] for _, parents in step if len(set(parents)) < len(parents)]
    assert len(branched) > 20  # it did draft trees, with branches
    assert logs["compiled"] == logs["python"]
    for key in ("num_tokens", "num_verify_steps", "mean_accepted_drafts_per_step", "draft_tokens_per_step",
                "num_tree_drafts", "tree_width_mean", "tree_depth_mean"):
        assert rows["compiled"][key] == rows["python"][key], key
    assert rows["compiled"]["num_tree_drafts"] > 0


def test_trees_bad_input_and_staged_tree_verdicts():
    """propose_trees refuses a bad max_nodes and unknown requests by name; a tree's verdict
    is staged like the other commits (counted at the next flush, unknown requests refused)."""
    d = CompiledDrafter(DrafterConfig(tree=True, max_tokens_per_prompt=1024, global_max_tokens=2048), max_slots=4)
    d.load_history("p", [[1, 2, 3, 4, 5], [1, 2, 3, 9]])
    d.start_request("r", "p", [7], [1, 2])
    with pytest.raises(ValueError, match="max_nodes"):
        d.propose_trees(["r"], [4], max_nodes="many")
    with pytest.raises(UnknownRequestError):
        d.propose_trees(["nope"], [4])
    with pytest.raises(UnknownRequestError):
        d.record_tree_acceptance("nope", [-1], [0])
    [(tokens, parents)] = d.propose_trees(["r"], [4], max_nodes=8)
    assert tokens[:1] == [3] and parents[0] == -1 and len(set(parents)) < len(parents)  # 3 then 4 or 9
    d.record_tree_acceptance("r", parents, [0, 1])
    d.add_tokens("r", [3, tokens[1], 5])
    assert d.stats().num_accepted_tokens == 2
    # more requests than the tree buffers were first made for: they grow
    for i in range(3):
        d.start_request(f"s{i}", "p", [7], [1])
    trees = d.propose_trees(["r", "s0", "s1", "s2"], [4] * 4, max_nodes=40, num_seqs=1)
    assert all(parents is not None for _, parents in trees) and trees[1][0][:1] == [2]


# -- bad input ------------------------------------------------------------------------

def _drafter(**kw) -> CompiledDrafter:
    d = CompiledDrafter(DrafterConfig(max_tokens_per_prompt=1024, global_max_tokens=2048), **kw)
    d.load_history("p", [[1, 2, 3, 4, 5], [1, 2, 3, 9]])
    return d


def test_bad_input_raises_and_the_drafter_keeps_working():
    d = _drafter()
    d.start_request("a", "p", [7, 8], [1, 2])
    before = d.propose(["a"], [8])
    for call, exc in [
        (lambda: d.start_request("b", "p", [7, -1]), ValueError),  # a token id out of range
        (lambda: d.start_request("b", "p", [7], [2**31]), ValueError),
        (lambda: d.start_request("a", "p", [7]), ValueError),  # already running
        (lambda: d.add_tokens("a", [3, -5]), ValueError),
        (lambda: d.add_tokens("a", [2**40]), ValueError),
        (lambda: d.add_tokens("a", [5, 2**31]), ValueError),  # fits the staging array (uint32), not an id
        (lambda: d.record_acceptance("a", 2**31, 0), ValueError),
        (lambda: d.add_tokens("a", ["x"]), ValueError),
        (lambda: d.add_tokens("nobody", [1]), UnknownRequestError),
        (lambda: d.record_acceptance("a", -1, 0), ValueError),
        (lambda: d.record_acceptance("nobody", 1, 0), UnknownRequestError),
        (lambda: d.propose(["a", "nobody"], [4, 4]), UnknownRequestError),
        (lambda: d.propose(["a"], [4, 4]), ValueError),
        (lambda: d.propose(["a"], [2**70]), ValueError),
        (lambda: d.stop_request("nobody"), UnknownRequestError),
        (lambda: d.load_history("p", [[1, 2], [3, -2]]), ValueError),
        (lambda: d.load_history("p", [[1, 2]], epoch_ages=[0, 1]), ValueError),
        (lambda: d.add_global_responses([[1], [2**31 + 3]]), ValueError),
        # a step's commits: nothing applied when any of them is bad
        (lambda: d.commit_step(["a", "nobody"], [0, 0], [0, 0], [1, 2], [1, 1]), UnknownRequestError),
        (lambda: d.commit_step(["a", "a"], [0, 0], [0, 0], [3, -5], [1, 1]), ValueError),
        (lambda: d.commit_step(["a", "a"], [0, 0], [0, 0], [3, 2**31], [1, 1]), ValueError),
        (lambda: d.commit_step(["a", "a"], [0, 0], [0, 0], [3, 4], [1, 2]), ValueError),  # counts != tokens
        (lambda: d.commit_step(["a"], [0], [0], [3], [-2]), ValueError),
        (lambda: d.commit_step(["a"], [-1], [0], [3], [1]), ValueError),  # (-1 is a tree's row inside)
        (lambda: d.commit_step(["a"], [2**31], [0], [3], [1]), ValueError),
        (lambda: d.commit_step(["a"], [1], [-3], [3], [1]), ValueError),
        (lambda: d.commit_step(["a"], [1, 2], [0], [3], [1]), ValueError),
        (lambda: d.commit_step(["a"], [0], [0], ["x"], [1]), ValueError),
    ]:
        with pytest.raises(exc):
            call()
    assert d.propose(["a"], [8]) == before  # nothing half-applied
    d.stop_request("a")
    with pytest.raises(UnknownRequestError):  # stopped
        d.add_tokens("a", [1])
    with pytest.raises(UnknownRequestError):
        d.propose(["a"], [4])


@pytest.mark.parametrize("cls", [HistoDrafter, CompiledDrafter])
def test_a_bad_commit_step_applies_nothing_so_the_engine_can_retry_request_by_request(cls):
    """The engines fall back to per-request calls when commit_step raises: that is only
    right if the failed call changed nothing (a request's tokens added twice would not be)."""
    def lifecycle(bad: bool) -> list:
        d = cls(DrafterConfig())
        d.start_request("a", "p", [7, 8, 9], [1, 2])
        d.start_request("b", "p", [7, 8, 9], [1, 2])
        d.propose(["a", "b"], [8, 8])
        if bad:
            with pytest.raises(UnknownRequestError):
                d.commit_step(["a", "b", "gone"], [0, 0, 0], [0, 0, 0], [3, 4, 5], [1, 1, 1])
        d.commit_step(["a", "b"], [0, 0], [0, 0], [3, 4, 1, 2, 3], [1, 4])
        return [d.propose(["a", "b"], [8, 8]), d.stats(), d.memory_tokens("p")]
    assert lifecycle(bad=True) == lifecycle(bad=False)


def test_empty_histories_prompts_and_huge_prompts_are_bounded():
    d = CompiledDrafter(DrafterConfig(max_tokens_per_prompt=4096, global_max_tokens=8192))
    d.load_history("e", [])
    d.load_history("e", [[], []])
    d.add_global_responses([])
    d.add_global_responses([[]])
    d.start_request("x", "e", [])
    assert d.propose(["x"], [8]) == [[]]  # nothing indexed: no draft
    d.add_tokens("x", [])
    big = np.arange(100_000) % 50_000  # a 100k-token prompt and a 100k-token resumed chunk
    d.start_request("y", "big", big, big)
    d.add_tokens("y", [1, 2, 3])
    d.propose(["x", "y"], [16, 16])
    d.add_global_responses([big])
    assert d.memory_tokens("big") <= 4096 and d.global_tokens() <= 8192
    assert d.memory_bytes("big") > 0
    d.stop_request("x")
    d.stop_request("y")


def test_more_requests_than_slots_is_refused_until_one_stops():
    d = _drafter(max_slots=2)
    d.start_request("a", "p", [1])
    d.start_request("b", "p", [1])
    with pytest.raises(DrafterFullError):
        d.start_request("c", "p", [1])
    with pytest.raises(ValueError):  # more requests in one call than slots
        d.propose(["a", "b", "a"], [1, 1, 1])
    d.stop_request("a")
    d.start_request("c", "p", [1])
    assert len(d.propose(["b", "c"], [4, 4])) == 2


def test_fuzzing_the_c_interface_never_crashes():
    """Hostile values straight into the C functions: error codes, never a crash."""
    codes = {}
    for seed in range(12):
        for rc, n in fuzz_ops.fuzz(seed).items():
            codes[rc] = codes.get(rc, 0) + n
    assert codes.get(0, 0) > 100 and codes.get(-1, 0) > 100  # both legal and refused calls ran


def test_a_missing_library_names_make_install(tmp_path):
    with pytest.raises(DrafterLibraryError, match="make install"):
        load_library(tmp_path / "libhisto.so")
    (tmp_path / "broken.so").write_bytes(b"not a library")
    with pytest.raises(DrafterLibraryError, match="make install"):
        load_library(tmp_path / "broken.so")


def test_a_library_of_another_abi_version_is_refused(tmp_path, monkeypatch):
    """A build of an older histo.cpp (e.g. ABI 4, before rhd_commit_bound) is refused by
    the loader with a line naming `make install`, not called with the wrong arguments."""
    import services.rollout.drafter.compiled as compiled

    copy = tmp_path / "libhisto_other.so"  # (another path: load_library caches per path)
    shutil.copyfile(compiled.LIBRARY, copy)
    monkeypatch.setattr(compiled, "ABI_VERSION", compiled.ABI_VERSION + 1)
    with pytest.raises(DrafterLibraryError, match="another version.*make install"):
        load_library(copy)


# -- the build --------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
@pytest.mark.parametrize("library, exported, internal", [
    (LIBRARY, "rhd_propose", "SuffixIndex"),  # the drafter core
    (GUMBEL_LIBRARY, "rhg_signed_units", "mix32"),  # the CPU sampler's RNG (same build script)
    (ATTENTION_LIBRARY, "rpa_scores", "scores_of"),  # the CPU paged attention's passes
], ids=["histo", "gumbel", "attention"])
def test_library_needs_nothing_newer_than_glibc_2_17(library, exported, internal):
    """The GPU machine's glibc may be older than this machine's: no symbol versioned above
    GLIBC_2.17, and no libstdc++/libgcc_s to find there (linked in statically)."""
    symbols = subprocess.run(["objdump", "-T", str(library)], capture_output=True, text=True, check=True).stdout
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_(\d+(?:\.\d+)+)", symbols)}
    assert max(versions, default=(2, 0)) <= (2, 17), sorted(versions)
    assert "GLIBCXX" not in symbols and "CXXABI" not in symbols
    needed = subprocess.run(["objdump", "-p", str(library)], capture_output=True, text=True, check=True).stdout
    libs = re.findall(r"NEEDED\s+(\S+)", needed)
    assert not any("stdc++" in lib or "gcc_s" in lib for lib in libs), libs
    assert re.search(rf"\b{exported}\b", symbols) and internal not in symbols  # only the C ABI exported


def _asan_runtime() -> str | None:
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return None
    path = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True,
                          check=False).stdout.strip()
    return path if os.path.isabs(path) and os.path.exists(path) else None


@pytest.mark.slow  # ~15 s, plus the sanitized build when `make test` has not made it
@pytest.mark.skipif(_asan_runtime() is None, reason="no AddressSanitizer runtime for the C++ compiler")
def test_sanitized_build_runs_the_property_tests_clean():
    """The core built with -fsanitize=address,undefined (any finding aborts) runs the
    random-lifecycle parity (and the wide states' one) and the C-interface fuzz in a subprocess."""
    lib = build.build(sanitize=True)
    env = dict(os.environ, LD_PRELOAD=_asan_runtime(), ASAN_OPTIONS="detect_leaks=0:abort_on_error=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1", RHYMERL_DRAFTER_LIBRARY=str(lib),
               PYTHONPATH=str(ROOT))
    script = ("import sys; from tests.rollout.drafter import parity_ops, fuzz_ops; "
              "from services.rollout.drafter.compiled import CompiledDrafter, library_path; "
              "assert library_path().name == 'libhisto_asan.so'; "
              "[parity_ops.compare(s, lambda c: CompiledDrafter(c, max_slots=64), 100) for s in range(30)]; "
              "[parity_ops.compare_wide(s, lambda c: CompiledDrafter(c, max_slots=16)) for s in range(10)]; "
              "[fuzz_ops.fuzz(s) for s in range(4)]; print('clean')")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, cwd=ROOT,
                          check=False)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_the_bundled_copy_is_checked_against_its_manifest(tmp_path):
    from services.rollout.drafter.compiled import _check_bundled

    lib = tmp_path / "lib" / "libhisto.so"
    lib.parent.mkdir()
    shutil.copy(LIBRARY, lib)
    digest = __import__("hashlib").sha256(lib.read_bytes()).hexdigest()
    (tmp_path / "manifest.json").write_text(f'{{"files": {{"lib/libhisto.so": {{"sha256": "{digest}"}}}}}}')
    _check_bundled(lib)
    (tmp_path / "manifest.json").write_text('{"files": {"lib/libhisto.so": {"sha256": "0"}}}')
    with pytest.raises(DrafterLibraryError, match="gpu-bundle"):
        _check_bundled(lib)


@pytest.mark.slow  # a worker process each (~10 s: its imports)
@pytest.mark.parametrize("drafter, refused", [("compiled", True), ("python", False)])
def test_a_worker_without_its_library_refuses_to_start_in_one_line(tmp_path, drafter, refused):
    """RHYMERL_WORKER_DRAFTER=compiled (the default) and no library: the worker exits at
    once with one line naming `make install`, before loading a model; never a silent
    fallback. With the Python drafter it goes on (and fails later, on the missing model)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), RHYMERL_DRAFTER_LIBRARY=str(tmp_path / "missing.so"),
               RHYMERL_WORKER_DRAFTER=drafter, RHYMERL_WORKER_MODEL_PATH=str(tmp_path / "no-model"),
               RHYMERL_WORKER_PORT="0", RHYMERL_WORKER_METRICS_PORT="0")
    proc = subprocess.run([sys.executable, "-m", "services.cli", "worker"], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "make install" in line]
    if refused:
        assert len(lines) == 1 and lines[0].startswith("rhymerl worker: ") and "Traceback" not in proc.stderr, \
            proc.stderr
        assert "loading" not in proc.stderr.split("make install")[0].split("\n")[-1]
    else:
        assert not lines, proc.stderr


# -- the cost threshold ---------------------------------------------------------------

@pytest.mark.parametrize("measured", [False, True])
def test_the_cost_threshold_the_core_computes_is_the_reference_function_bit_for_bit(measured):
    """rhd_step prices drafts with budget.gain_threshold computed in C++ on the cost model's
    curve: it must equal the Python function exactly (Python's round-half-even of the
    token count, the curve's bisect and its segment at the ends, the slope's clamp), on the
    H100 prior and on a measured curve as it changes."""
    model = CostModel(measure=measured, min_samples=1)
    drafter = CompiledDrafter(DrafterConfig(cost_model=model), max_slots=4)
    rng = np.random.default_rng(0)
    for round_ in range(4):
        if measured:  # a new measured curve each round (the core must be handed each one)
            for bucket in (1, 8, 32, 64, 256, 1024):
                model.observe(bucket, float(rng.uniform(0.5, 9.0)))
        for num_seqs in [1, 2, 3, 7, 15, 16, 17, 63, 64, 255, 256, 1000, 5000]:
            # x.5 token counts (ties round to even), integers, and arbitrary statistics
            for draft_per_seq in (0.0, 0.5, 1.5, 2.5, 0.25, float(rng.uniform(0, 16))):
                gain_per_seq = float(rng.uniform(0, 4))
                want = gain_threshold(model, num_seqs, draft_per_seq, gain_per_seq)
                assert drafter.gain_threshold(num_seqs, draft_per_seq, gain_per_seq) == want, \
                    (round_, num_seqs, draft_per_seq)


def test_one_requests_commits_through_its_row_agree_with_the_reference():
    """A one-request commit_step goes through a row of its own (``_commit_one``: the bound
    block pointed at it, its buffer grown past 64 tokens); mixed with the columns' path
    (several requests) and staged calls, the drafts equal the Python reference's, and a
    bad row (a negative or too large token, counts that disagree) applies nothing."""
    history = [[5, 6, 7, 8, 9] * 30, [5, 6, 7, 1, 2, 3, 4] * 20]
    drafters = [CompiledDrafter(DrafterConfig()), HistoDrafter(DrafterConfig())]
    got = []
    for d in drafters:
        d.load_history("p", history)
        d.start_request("a", "p", [3, 3])
        d.start_request("b", "p", [3, 3], [5])
        out = []
        for tokens in ([5, 6], [7, 8, 9] * 40, [5], list(range(1, 130)), [6, 7]):
            out.append(d.propose(["a"], [8]))
            d.commit_step(["a"], [len(out[-1][0])], [0], tokens, [len(tokens)])
            out.append(d.propose(["a", "b"], [8, 8]))
            d.commit_step(["a", "b"], [0, 0], [0, 0], [5, 6, 7], [2, 1])
            d.add_tokens("b", [8])  # (staged: applied before the next call)
        if isinstance(d, CompiledDrafter):
            before = d.propose(["a"], [8])
            for bad in (([-1], [1]), ([2**31], [1]), ([3, 4], [1]), ([3], [-2])):
                with pytest.raises(ValueError):
                    d.commit_step(["a"], [0], [0], *bad)
            assert d.propose(["a"], [8]) == before
        out.append(d.propose(["a", "b"], [8, 8]))
        got.append(out)
    assert got[0] == got[1]


def test_a_steps_new_stop_sets_go_to_the_core_in_one_call(monkeypatch):
    """A step whose requests bring new stop sets (each request's first propose) hands them
    all over in one ``rhd_set_stops_many`` call, one alone through ``rhd_set_stops``, none
    when they are the same objects as before; the drafts stop as the Python reference's
    do, out-of-range stop ids ignored, whichever way the stops arrived."""
    history = [[5, 6, 7, 8, 9] * 10, [5, 6, 7, 1, 2, 3, 4] * 8]
    compiled = CompiledDrafter(DrafterConfig())
    calls = {"many": 0, "one": 0}
    lib = compiled._lib
    many, one = lib.rhd_set_stops_many, lib.rhd_set_stops

    def counted_many(*args):
        calls["many"] += 1
        return many(*args)

    def counted_one(*args):
        calls["one"] += 1
        return one(*args)

    monkeypatch.setattr(lib, "rhd_set_stops_many", counted_many)
    monkeypatch.setattr(lib, "rhd_set_stops", counted_one)
    steps = [
        [frozenset({7}), frozenset({8, 2**31, -1}), frozenset(), frozenset({6, 9})],  # new: one call
        None,  # the same objects again (set below): no call
        [frozenset({9})],  # one request's alone: rhd_set_stops
    ]
    got = []
    for d in (compiled, HistoDrafter(DrafterConfig())):
        d.load_history("p", history)
        for r in "abcd":
            d.start_request(r, "p", [3, 3], [5])
        out, first = [], steps[0]
        for stops in (first, first, steps[2]):
            ids = list("abcd")[:len(stops)]
            out.append(d.propose(ids, [8] * len(ids), stop_token_ids=stops))
            d.commit_step(ids, [0] * len(ids), [0] * len(ids), [6] * len(ids), [1] * len(ids))
        got.append(out)
    assert got[0] == got[1]
    assert any(len(d) for d in got[0][0])
    assert calls == {"many": 1, "one": 1}
