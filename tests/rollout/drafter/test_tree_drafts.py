"""HistoDrafter's draft trees (tree_walk.py, DrafterConfig.tree): branches where the
sources disagree, best first within the node cap, depth cap and the batch's budget; the
linear draft whenever trees are off or the batch is larger than tree_max_batch.

If these fail, the engine gets trees that waste verify rows on unlikely branches, trees
past max_tokens or stop tokens, or trees where a linear draft was configured."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rollout.drafter import DrafterConfig, HistoDrafter
from services.rollout.engine.tree import check_tree, depths

# Two earlier responses that share "10 11" then go different ways.
FORK = [[10, 11, 20, 21, 22, 23], [10, 11, 30, 31, 32, 33]]


def _drafter(**kw) -> HistoDrafter:
    kw.setdefault("use_global", False)
    kw.setdefault("min_gain", 0.0)
    return HistoDrafter(DrafterConfig(**kw))


def _paths(tokens: list[int], parents: list[int]) -> set[tuple[int, ...]]:
    """Every node's tokens from the root."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return set(paths)


def test_both_continuations_of_a_fork_are_branches():
    """After "10 11" the history went to 20 and to 30: the tree holds both continuations
    (the linear draft only one of them)."""
    drafter = _drafter(tree=True, max_draft_len=4)
    drafter.load_history("p", FORK)
    drafter.start_request("r", "p", [1, 2], [10, 11])
    [(tokens, parents)] = drafter.propose_trees(["r"], [4], max_nodes=8)
    check_tree(tokens, parents)
    paths = _paths(tokens, parents)
    assert {(20, 21, 22), (30, 31, 32)} <= paths
    assert max(depths(parents)) <= 4
    linear = _drafter(max_draft_len=4)
    linear.load_history("p", FORK)
    linear.start_request("r", "p", [1, 2], [10, 11])
    [draft] = linear.propose(["r"], [4])
    assert tuple(draft[:3]) in {(20, 21, 22), (30, 31, 32)}


def test_trees_off_or_a_large_batch_give_the_linear_drafts():
    """tree=False (the default), or more requests than tree_max_batch: exactly propose's
    drafts, as linear drafts (parents None)."""
    for cfg in (dict(), dict(tree=True, tree_max_batch=1)):
        a, b = _drafter(max_draft_len=5, **cfg), _drafter(max_draft_len=5)
        for d in (a, b):
            d.load_history("p", FORK)
            d.start_request("r", "p", [1], [10])
            d.start_request("s", "p", [1], [10, 11])
        assert a.propose_trees(["r", "s"], [5, 5]) == [(d, None) for d in b.propose(["r", "s"], [5, 5])]
    assert not HistoDrafter().tree_drafts and HistoDrafter(DrafterConfig(tree=True)).tree_drafts


def test_a_single_continuation_is_a_chain():
    """Where every source agrees there is nothing to branch on: the tree is the linear
    draft (width 1 would give the same tokens)."""
    drafter = _drafter(tree=True, max_draft_len=4, tree_width=3)
    drafter.load_history("p", [[5, 6, 7, 8, 9, 10]])
    drafter.start_request("r", "p", [1], [5])
    [(tokens, parents)] = drafter.propose_trees(["r"], [4], max_nodes=8)
    assert tokens[:4] == [6, 7, 8, 9] and parents[:4] == [-1, 0, 1, 2]


@settings(max_examples=40, deadline=None)
@given(history=st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=25), min_size=1, max_size=5),
       generated=st.lists(st.lists(st.integers(0, 6), max_size=12), min_size=1, max_size=4),
       stops=st.frozensets(st.integers(0, 6), max_size=2),
       max_len=st.integers(0, 8), max_nodes=st.integers(0, 24), width=st.integers(1, 4),
       budget=st.one_of(st.none(), st.integers(0, 30)))
def test_trees_keep_every_cap(history, generated, stops, max_len, max_nodes, width, budget):
    """For any history: each tree is a tree in topological order with distinct siblings,
    at most max_nodes nodes and max_lens deep, no node below a stop token, the batch
    within the budget; gains (the calibration state) stay usable by the next step."""
    drafter = _drafter(tree=True, max_draft_len=8, tree_width=width, use_global=True)
    drafter.add_global_responses(history[::-1])
    drafter.load_history("p", history)
    rids = [f"r{i}" for i in range(len(generated))]
    for rid, gen in zip(rids, generated):
        drafter.start_request(rid, "p", [0, 1], gen)
    trees = drafter.propose_trees(rids, [max_len] * len(rids), [stops] * len(rids), budget, max_nodes=max_nodes)
    for tokens, parents in trees:
        assert parents is not None
        check_tree(tokens, parents)
        assert len(tokens) <= max_nodes
        assert all(d <= max_len for d in depths(parents))
        assert all(tokens[p] not in stops for p in parents if p >= 0)
    if budget is not None:
        assert sum(len(t) for t, _ in trees) <= budget
    rng = random.Random(len(history))
    for rid, (tokens, parents) in zip(rids, trees):  # a verdict: some path of the tree
        path, node = [], -1
        while True:
            kids = [i for i, p in enumerate(parents) if p == node]
            if not kids or rng.random() < 0.3:
                break
            node = rng.choice(kids)
            path.append(node)
        drafter.record_tree_acceptance(rid, parents, path)
        drafter.add_tokens(rid, [tokens[i] for i in path] + [0])
    drafter.propose_trees(rids, [max_len] * len(rids), [stops] * len(rids), budget, max_nodes=max_nodes)
    assert drafter.stats().num_accepted_tokens >= 0


def test_trees_grow_best_first_across_the_batch():
    """A tight budget goes to the most likely nodes of the batch: a prefix of each tree's
    best-first order (a tree), no request's node below another's that was cut."""
    drafter = _drafter(tree=True, max_draft_len=6)
    drafter.load_history("p", FORK + [[10, 11, 20, 21, 22, 23]])
    drafter.load_history("q", [[40, 41, 42, 43, 44]])
    drafter.start_request("r", "p", [1], [10, 11])
    drafter.start_request("s", "q", [1], [40])
    whole = drafter.propose_trees(["r", "s"], [6, 6], max_nodes=10)
    drafter2 = _drafter(tree=True, max_draft_len=6)
    drafter2.load_history("p", FORK + [[10, 11, 20, 21, 22, 23]])
    drafter2.load_history("q", [[40, 41, 42, 43, 44]])
    drafter2.start_request("r", "p", [1], [10, 11])
    drafter2.start_request("s", "q", [1], [40])
    cut = drafter2.propose_trees(["r", "s"], [6, 6], budget=5, max_nodes=10)
    assert sum(len(t) for t, _ in cut) == 5
    for (tokens, parents), (wt, wp) in zip(cut, whole):
        assert tokens == wt[:len(tokens)] and parents == wp[:len(parents)]


@pytest.mark.parametrize("temperature,kind", [(0.0, "python"), (1.0, "python"), (1.0, "compiled")])
def test_history_tree_drafter_in_the_engine_is_lossless(temperature, kind):
    """The drafter's trees (the Python reference's, the compiled core's) through the CPU
    engine: plain decoding's tokens, trees really verified, and some of their tokens accepted."""
    from services.rollout.drafter.compiled import make_drafter

    import torch

    from tests.rollout.engine.test_engine import (CONFIG, _engine_with, init_random_model, make_request,
                                                  prompt_of, run_to_end)

    torch.manual_seed(0)
    model = init_random_model(CONFIG, seed=1)
    prompt = prompt_of(10)
    reqs = [make_request(i, prompt, prompt_id="p", temperature=temperature, max_tokens=20, max_new_tokens=20)
            for i in range(4)]
    plain = run_to_end(_engine_with(model, reqs, speculative=False))
    drafter = make_drafter(kind, DrafterConfig(tree=True), max_slots=16)
    # last epoch's responses, and their variants with a token changed: forks to branch on
    history = [plain[f"r{i}"].token_ids for i in range(4)]
    history += [h[:5] + [(h[5] + 1) % CONFIG.vocab_size] + h[6:] for h in history]
    drafter.load_history("p", history)
    engine = _engine_with(model, reqs, drafter=drafter)
    assert engine.tree_drafts
    spec = run_to_end(engine)
    for rid in plain:
        assert spec[rid].token_ids == plain[rid].token_ids
    c = engine.metrics.counters
    assert c.num_tree_drafts > 0 and c.num_accepted_tokens > 0


def test_the_worker_switch_takes_either_drafter_and_is_refused_with_vllm():
    """RHYMERL_WORKER_TREE_DRAFTS is off by default; on, it works with the compiled drafter
    (the worker's default) and the Python one, and is refused, naming it, with vLLM's engine
    (which verifies no trees of ours)."""
    from services.rollout.settings import WorkerSettings

    assert not WorkerSettings().tree_drafts
    assert WorkerSettings(tree_drafts=True).tree_drafts and WorkerSettings().drafter == "compiled"
    assert WorkerSettings(tree_drafts=True, drafter="python").tree_drafts
    with pytest.raises(ValueError, match="RHYMERL_WORKER_TREE_DRAFTS"):
        WorkerSettings(tree_drafts=True, engine="vllm")


# ------------------------------------------------------------------ the replay (drafter_bench)

def test_the_replay_accepts_a_tree_s_true_path_wherever_it_sits():
    """drafter_replay with a tree drafter: a tree whose true continuation is its last
    branch is accepted along that branch (the verifier's walk), every node counted as
    verified; the tail columns count the steps with <= 16 sequences."""
    from benchmarks import drafter_replay as R

    traces = R.synthetic_traces(num_prompts=1, num_epochs=1, num_samples=2, seed=3)
    truth = {f"{t.prompt_id}/{t.epoch}/{t.sample_index}": t.token_ids for t in traces}

    class Fork:
        """Two wrong children of the root, then the next 3 true tokens as a chain."""
        tree_drafts = True

        def __init__(self):
            self.done: dict[str, int] = {}
            self.paths: list[list[int]] = []

        def start_request(self, rid, prompt_id, prompt, generated=()):
            self.done[rid] = 0

        def propose_trees(self, rids, max_lens, stops=None, budget=None, max_nodes=16, **kw):
            out = []
            for rid in rids:
                seq, p = truth[rid], self.done[rid]
                true = seq[p:p + 3]
                wrong = [(true[0] + 1) % 6000 if true else 1, (true[0] + 2) % 6000 if true else 2]
                out.append((wrong + true, [-1, -1] + [-1, 2, 3][:len(true)]))
            return out

        def add_tokens(self, rid, tokens):
            self.done[rid] += len(tokens)

        def record_tree_acceptance(self, rid, parents, path):
            self.paths.append(path)

        def record_acceptance(self, rid, n, a):
            raise AssertionError("trees only")

        def stop_request(self, rid):
            pass

    fork = Fork()
    row = R.replay(traces, lambda: fork, None, "fork")
    assert row["num_tokens"] == sum(len(t.token_ids) for t in traces)
    assert row["mean_accepted_drafts_per_step"] > 2.5  # 3 accepted at almost every step
    assert row["draft_tokens_per_step"] > 4.5 and row["tail_num_verify_steps"] == row["num_verify_steps"]
    assert all(path[:1] == [2] for path in fork.paths if path)
    assert row["num_tree_drafts"] == row["num_verify_steps"] and row["tree_width_mean"] == 3


def test_only_trees_writes_the_tree_figures(tmp_path, monkeypatch):
    """--only-trees: drafter_trees.{md,json} with the issue's keys per trace set."""
    import numpy as np

    from benchmarks import drafter_bench
    from benchmarks import drafter_replay as R
    from benchmarks.peers.suffix_decoding import PeerUnavailable
    from services.common.traces import TraceRecord, write_traces

    monkeypatch.setattr(drafter_bench, "load_peer", lambda: (_ for _ in ()).throw(PeerUnavailable("not here")))
    synthetic = R.synthetic_traces(num_prompts=1, num_epochs=2, num_samples=2, seed=2)
    records = [TraceRecord(t.prompt_id, t.epoch, t.sample_index, t.epoch, np.array(t.prompt_token_ids, np.int32),
                           np.array(t.token_ids, np.int32), np.zeros(len(t.token_ids), np.float32), t.reward)
               for t in synthetic]
    write_traces(tmp_path / "t.npz", records)
    summary = drafter_bench.main(["--traces", str(tmp_path / "t.npz"), "--out", str(tmp_path), "--only-trees"])
    assert (tmp_path / "drafter_trees.json").exists() and (tmp_path / "drafter_trees.md").exists()
    (entry,) = summary["trace_sets"]
    assert entry["rhymerl_tree_mean_accepted"] > 0 and entry["rhymerl_tree_verified_per_step"] > 0
    assert entry["peer_suffix_tail_mean_accepted"] is None
    assert set(entry["modeled_speedup"]) == {"1", "16", "64", "256"}
    assert all(v["rhymerl_tree"] > 0 for v in entry["modeled_speedup"].values())
    assert {r["config"]: r["backend"] for r in entry["rows"]} == {
        "rhymerl": "compiled", "rhymerl/tree": "compiled", "rhymerl/tree-python": "python"}
    assert entry["rhymerl_tree_tail_propose_us"]["compiled"]["propose_p50"] > 0


def test_tree_min_gain_sets_the_tree_s_floor_only():
    """tree_min_gain bounds the tree's nodes (a higher floor: a sub-tree of the lower
    floor's, best first); linear drafts keep min_gain."""
    def trees(**kw):
        drafter = _drafter(tree=True, max_draft_len=6, **kw)
        drafter.load_history("p", FORK + [[10, 11, 20, 21, 22, 23]] * 3)
        drafter.start_request("r", "p", [1], [10, 11])
        return drafter.propose_trees(["r"], [6], max_nodes=16)[0], drafter.propose(["r"], [6])[0]

    (low, low_parents), linear_low = trees(tree_min_gain=0.0)
    (high, high_parents), linear_high = trees(tree_min_gain=0.5)
    assert 0 < len(high) < len(low)
    assert (high, high_parents) == (low[:len(high)], low_parents[:len(high)])
    assert linear_low == linear_high  # min_gain (0.0 here) still rules linear drafts
