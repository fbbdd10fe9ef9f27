"""The drafter benchmark: one replay drives rhymerl's drafter and vLLM's suffix method.

If these fail, benchmarks/results/drafter.md compares drafters on different steps (the
peer advantaged or handicapped), drives the peer otherwise than vLLM does, or the
results lose the issue's format."""

from __future__ import annotations

import os

import numpy as np
import pytest

from benchmarks import drafter_bench
from benchmarks import drafter_replay as R
from benchmarks.peers.suffix_decoding import MAX_TREE_DEPTH, PeerSuffixDrafter, PeerUnavailable, load_peer
from services.common.traces import TraceRecord, write_traces
from services.rollout.drafter import DrafterConfig, HistoDrafter


class _Draft:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class FakeSuffixCache:
    """SuffixDecodingCache's calls, answered by a brute-force longest-match lookup over
    every response it was given; it records what it saw."""

    def __init__(self) -> None:
        self.prompts: dict[str, list[int]] = {}
        self.responses: dict[str, list[int]] = {}
        self.contexts: list[list[int]] = []
        self.stopped: list[str] = []

    def start_request(self, req_id, prompt):
        self.prompts[req_id], self.responses[req_id] = list(prompt), []

    def add_active_response(self, req_id, tokens):
        self.responses[req_id] += list(tokens)

    def stop_request(self, req_id):
        self.stopped.append(req_id)

    def speculate(self, req_id, context, max_spec_tokens, max_spec_factor, min_token_prob):
        self.contexts.append(list(context))
        for n in range(len(context), 0, -1):
            for other, text in self.responses.items():
                for i in range(len(text) - n):
                    if other != req_id and text[i:i + n] == list(context[-n:]):
                        return _Draft(text[i + n:i + n + min(max_spec_tokens, n)])
        return _Draft([])


def test_one_replay_drives_ours_and_the_peer_on_the_same_steps():
    """The same replay function drives rhymerl's drafter and the peer adapter: both
    commit exactly the traces' tokens; the peer sees vLLM's calls (the prompt at start,
    every committed token appended, the last max_tree_depth tokens of prompt + response
    as the context, every request stopped)."""
    traces = R.synthetic_traces(num_prompts=2, num_epochs=2, num_samples=3, seed=1)
    stop = R.stop_token(traces)
    fake = FakeSuffixCache()
    peer = R.replay(traces, lambda: PeerSuffixDrafter(lambda: fake), stop, "peer")
    ours = R.replay(traces, lambda: HistoDrafter(DrafterConfig()), stop, "ours")
    total = sum(len(t.token_ids) for t in traces)
    assert peer["num_tokens"] == ours["num_tokens"] == total
    assert peer["mean_accepted_drafts_per_step"] > 0 and ours["mean_accepted_drafts_per_step"] > 0
    by_id = {f"{t.prompt_id}/{t.epoch}/{t.sample_index}": t for t in traces}
    assert set(fake.responses) == set(by_id) == set(fake.stopped)
    for rid, t in by_id.items():
        assert fake.prompts[rid] == t.prompt_token_ids and fake.responses[rid] == t.token_ids
    assert all(0 < len(c) <= MAX_TREE_DEPTH for c in fake.contexts)


def test_the_real_peer_replays_if_built():
    """vLLM's suffix method itself (built by `make test` and `make bench`) runs through the replay."""
    try:
        cache = load_peer()
    except PeerUnavailable as exc:
        if os.environ.get("RHYMERL_REQUIRE_PEER"):  # make test built it: missing is a failure
            pytest.fail(f"peer not built: {exc}")
        pytest.skip(f"peer not built: {exc} (make peer)")
    traces = R.synthetic_traces(num_prompts=2, num_epochs=2, num_samples=3, seed=1)
    row = R.replay(traces, lambda: PeerSuffixDrafter(lambda: cache(MAX_TREE_DEPTH, 10_000)), R.stop_token(traces))
    assert row["num_tokens"] == sum(len(t.token_ids) for t in traces)
    assert 0 < row["mean_accepted_drafts_per_step"] and row["draft_tokens_per_step"] <= 16


def test_modeled_speedup_follows_the_engine_cost_curve():
    """No drafts: no speedup; free accepted tokens at batch 1 pay almost in full; the same
    drafts pay less in a full batch, where extra tokens cost."""
    assert R.modeled_speedup(16, 0.0, 0.0) == pytest.approx(1.0)
    assert R.modeled_speedup(1, 4.0, 2.0) > 2.9
    assert R.modeled_speedup(256, 4.0, 2.0) < R.modeled_speedup(16, 4.0, 2.0)


def test_main_writes_the_trace_sets_results(tmp_path, monkeypatch):
    """--traces PATH... replays each file and writes drafter.md/.json with the issue's
    `trace_sets` format (the peer's figures null, with the reason, when it is not built)."""
    monkeypatch.setattr(drafter_bench, "load_peer", lambda: (_ for _ in ()).throw(PeerUnavailable("not here")))
    synthetic = R.synthetic_traces(num_prompts=1, num_epochs=2, num_samples=2, seed=2)
    records = [TraceRecord(t.prompt_id, t.epoch, t.sample_index, t.epoch,
                           np.array(t.prompt_token_ids, np.int32), np.array(t.token_ids, np.int32),
                           np.zeros(len(t.token_ids), np.float32), t.reward) for t in synthetic]
    path = tmp_path / "traces.npz"
    write_traces(path, records)
    summary = drafter_bench.main(["--traces", str(path), "--out", str(tmp_path)])
    assert (tmp_path / "drafter.md").exists() and (tmp_path / "drafter.json").exists()
    (entry,) = summary["trace_sets"]
    assert entry["name"] == str(path) and "--traces" in entry["command"]
    for key in ("rhymerl_mean_accepted", "rhymerl_draft_per_verify", "peer_suffix_mean_accepted",
                "peer_suffix_draft_per_verify", "peer_suffix_per_prompt_mean_accepted", "drafting_us_p99"):
        assert key in entry
    assert entry["peer_suffix_mean_accepted"] is None and summary["peer"]["note"] == "not here"
    assert set(entry["modeled_speedup"]) == {"1", "16", "64", "256"}
    assert all(v["rhymerl"] > 0 and v["peer"] is None for v in entry["modeled_speedup"].values())
    assert summary["rhymerl_mean_accepted"] == entry["rhymerl_mean_accepted"]  # the old keys stay
    # issue 24: a backend per row, the drafter's time per step side by side, same drafts
    by_name = {r["config"]: r for r in entry["rows"]}
    assert by_name["rhymerl"]["backend"] == "compiled" and by_name["rhymerl/python"]["backend"] == "python"
    assert all(r["backend"] in ("compiled", "python", "peer", "ngram", "oracle") for r in entry["rows"])
    steps = summary["drafter_step_us"]
    assert set(steps) == {"compiled", "python", "peer", "floor"} and steps["peer"] is None
    for name in ("compiled", "python", "floor"):
        assert set(steps[name]) >= {"propose_p50", "propose_p99", "commit_p50", "commit_p99", "step_ms_100plus",
                                    "one_seq_p99"}
        assert steps[name]["one_seq_p99"] is not None
    assert entry["compiled_vs_python_identical_drafts"] == 1.0 and entry["compiled_vs_python_num_drafts"] > 0
    assert "load_average_1min" in summary and summary["git_commit"] and summary["command"]


def test_oracle_is_a_ceiling_every_token_accepted_and_at_least_ours():
    """The oracle drafts only true next tokens that a source saw after the context (all
    accepted), accepts at least what rhymerl's drafter does on the same replay, and the
    longest-context oracle at most what the any-context one does. If this fails, the
    ceiling reported in drafter.json is not one."""
    from benchmarks.drafter_oracle import OracleDrafter

    traces = R.synthetic_traces(num_prompts=2, num_epochs=3, num_samples=4, seed=5)
    stop = R.stop_token(traces)
    truth = {f"{t.prompt_id}/{t.epoch}/{t.sample_index}": t.token_ids for t in traces}
    ours = R.replay(traces, lambda: HistoDrafter(DrafterConfig(min_gain=0.0)), stop, "ours")
    ceiling = R.replay(traces, lambda: OracleDrafter(truth, DrafterConfig()), stop, "oracle")
    longest = R.replay(traces, lambda: OracleDrafter(truth, DrafterConfig(), longest_only=True), stop, "longest")
    for row in (ceiling, longest):
        assert row["acceptance_rate"] == 1.0 and row["draft_tokens_per_step"] > 0
    assert ceiling["mean_accepted_drafts_per_step"] >= longest["mean_accepted_drafts_per_step"]
    assert ceiling["mean_accepted_drafts_per_step"] >= ours["mean_accepted_drafts_per_step"]


def test_oracle_drafts_nothing_a_source_never_saw():
    """With no history, no siblings and an empty global index, the truth is unknown to
    every source: the oracle drafts nothing (it may not invent tokens)."""
    from benchmarks.drafter_oracle import OracleDrafter

    truth = {"r": [7, 8, 9, 10], "s": [7, 8, 9, 10]}
    oracle = OracleDrafter(truth, DrafterConfig())
    oracle.start_request("r", "p", [1, 2])
    assert oracle.propose(["r"], [16]) == [[]]
    oracle.add_global_responses([[7, 8, 9, 5]])  # another prompt's response, seen before "s" starts
    oracle.start_request("s", "q", [3])
    assert oracle.propose(["s"], [16]) == [[7, 8, 9]]  # anchored at the response's start, not past it


class _Collecting(HistoDrafter):
    """The reference drafter, with a full garbage collection inside every propose and
    every commit_step (over enough live objects that each pause is far above the clock's
    resolution)."""

    garbage = [[i] for i in range(100_000)]

    def propose(self, *args, **kwargs):
        import gc

        gc.collect()
        return super().propose(*args, **kwargs)

    def commit_step(self, *args, **kwargs):
        import gc

        gc.collect()
        return super().commit_step(*args, **kwargs)


def test_step_timings_are_net_of_collections_inside_the_spans():
    """A collection that starts inside a drafter call scans the whole process's young (or
    all) objects: the replay counts those pauses and times the drafter net of them, the
    figures with them beside (`with_gc`). If this fails, a collection set off by the
    replay's own bookkeeping is billed to the drafter again (it set the one-sequence p99
    and moved the >= 100-sequence step's mean by 2x from run to run), or the pauses are
    no longer reported."""
    traces = [R.Trace("p", 0, 0, [1, 2, 3], [5, 6, 7, 8, 9, 10], 1.0)]  # one sequence: every step a one-sequence step
    row = R.replay(traces, lambda: _Collecting(DrafterConfig()), None, "collecting")
    steps = row["drafter_step_us"]
    assert steps["num_one_seq_steps"] == row["num_verify_steps"] > 0
    assert steps["gc_collections_in_spans"] >= 2 * steps["num_one_seq_steps"]  # a propose's and a commit's
    assert steps["gc_ms_in_spans"] > 0
    assert steps["one_seq_p99"] < steps["with_gc"]["one_seq_p99"]


def test_the_crossing_floor_crosses_once_a_call_and_drafts_nothing():
    """The `floor` backend of drafter.json: each engine step of the replay makes one
    propose and one commit_step on it, each one empty crossing into the core, and it drafts
    nothing (so every step commits one token per sequence). If this fails, the floor
    printed beside the drafters' step times times other work than the calls' own."""
    traces = R.synthetic_traces(num_prompts=2, num_epochs=2, num_samples=3, seed=4)
    made = []

    def make():
        floor = R.CrossingFloor()
        cross = floor._cross
        floor.crossings = 0

        def counted():
            floor.crossings += 1
            return cross()
        floor._cross = counted
        made.append(floor)
        return floor

    row = R.replay(traces, make, R.stop_token(traces), "floor")
    (floor,) = made
    engine_steps = sum(max(len(t.token_ids) for t in traces if t.epoch == e) for e in {t.epoch for t in traces})
    assert floor.crossings == 2 * engine_steps
    assert row["draft_tokens_per_step"] == 0 and row["num_tokens"] == row["num_verify_steps"]
    assert row["drafter_step_us"]["num_one_seq_steps"] > 0
