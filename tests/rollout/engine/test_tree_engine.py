"""Tree speculation in the CPU engine: random draft trees (the true continuation hidden
among wrong branches, or cut short, or absent) give exactly the output of plain decoding,
greedy and at T=1 with the same seeds; the KV after tree steps is the KV of plain
decoding of the committed tokens; batch-invariant mode stays bitwise; tree steps replay
the verify graphs of their token count.

If these fail, tree speculation changes the samples the trainer gets, or leaves a
rejected branch's KV where the next tokens read it."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.rollout.engine.tree import depths
from tests.rollout.engine.test_engine import (CONFIG, EagerGraphs, _engine_with, init_random_model, make_request,
                                              new_engine, prompt_of, run_to_end)

VOCAB = CONFIG.vocab_size


class TreeOracleDrafter:
    """Proposes random trees around the true continuation (known from a plain run): the
    true branch for a random number of tokens (0: absent), wrong siblings beside it
    (placed before it in the flat order when ``true_last``, so the accepted path's KV must
    move), and random extra branches; the nodes in a random topological order."""

    tree_drafts = True

    def __init__(self, continuations: dict[str, list[int]], seed: int, true_last: bool = False,
                 max_wrong: int = 2):
        self.continuations = continuations
        self.rng = random.Random(seed)
        self.true_last = true_last
        self.max_wrong = max_wrong
        self.generated: dict[str, list[int]] = {}
        self.paths: list[tuple[int, int]] = []  # per verified tree: (nodes, accepted)
        self.linear: list[tuple[int, int]] = []

    def start_request(self, request_id, prompt_id, prompt_token_ids, generated_token_ids=()):
        self.generated[request_id] = list(generated_token_ids)

    def add_tokens(self, request_id, token_ids):
        self.generated[request_id].extend(token_ids)

    def stop_request(self, request_id):
        del self.generated[request_id]

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        raise AssertionError("a tree drafter is asked for trees")

    def record_acceptance(self, request_id, num_draft, num_accepted):
        self.linear.append((num_draft, num_accepted))

    def record_tree_acceptance(self, request_id, parents, path):
        assert all(-1 <= p < i for i, p in enumerate(parents)) and all(-1 <= a < b for a, b in zip([-1] + path, path))
        self.paths.append((len(parents), len(path)))

    def propose_trees(self, request_ids, max_lens, stop_token_ids=None, budget=None, max_nodes=16):
        return [self._tree(rid, max_len, max_nodes) for rid, max_len in zip(request_ids, max_lens)]

    def _tree(self, rid: str, max_depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        rng, done = self.rng, len(self.generated[rid])
        truth = self.continuations[rid][done:done + max_depth]
        true_len = rng.randrange(0, len(truth) + 1)
        paths: list[tuple[int, ...]] = []  # each node as its tokens from the root
        for d in range(true_len + 1):
            for _ in range(rng.randrange(0, self.max_wrong + 1)):  # wrong siblings at depth d + 1
                if d < max_depth:
                    wrong = (truth[d] + rng.randrange(1, VOCAB)) % VOCAB if d < len(truth) else rng.randrange(VOCAB)
                    paths.append(tuple(truth[:d]) + (wrong,))
            if d < true_len:
                paths.append(tuple(truth[:d + 1]))
        for _ in range(rng.randrange(0, 4)):  # random branches under random nodes
            base = rng.choice([()] + paths)
            if len(base) < max_depth:
                paths.append(base + (rng.randrange(VOCAB),))
        unique = list(dict.fromkeys(paths))
        if self.true_last:  # wrong nodes first: the accepted path sits at later rows
            unique.sort(key=lambda p: (p == tuple(truth[:len(p)]), len(p)))
        # a topological order: a node after its parent (random among the ready ones unless true_last)
        order: list[tuple[int, ...]] = []
        placed = {(): -1}
        pending = unique
        while pending and len(order) < max_nodes:
            ready = [p for p in pending if p[:-1] in placed]
            node = ready[0] if self.true_last else rng.choice(ready)
            pending = [p for p in pending if p != node]
            placed[node] = len(order)
            order.append(node)
        return [p[-1] for p in order], [placed[p[:-1]] for p in order]


def plain_outputs(model, reqs, **kw):
    return run_to_end(_engine_with(model, reqs, speculative=False, **kw))


def sampled_requests(temperature: float, seed: int, n: int = 3) -> list:
    rng = random.Random(seed)
    return [make_request(i, prompt_of(rng.randrange(1, 12), seed + i), temperature=temperature,
                         max_tokens=rng.randrange(4, 14), max_new_tokens=14, seed=seed * 10 + i) for i in range(n)]


@pytest.fixture(scope="module")
def model():
    from tests.rollout.engine.test_engine import init_random_model

    torch.manual_seed(0)
    return init_random_model(CONFIG, seed=1)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), temperature=st.sampled_from([0.0, 1.0]), true_last=st.booleans(),
       max_draft_len=st.integers(1, 8))
def test_tree_speculation_equals_plain_decoding(model, seed, temperature, true_last, max_draft_len):
    reqs = sampled_requests(temperature, seed)
    plain = plain_outputs(model, reqs)
    drafter = TreeOracleDrafter({rid: o.token_ids for rid, o in plain.items()}, seed, true_last)
    engine = _engine_with(model, reqs, drafter=drafter, max_draft_len=max_draft_len)
    assert engine.tree_drafts
    spec = run_to_end(engine)
    for rid, out in plain.items():
        assert spec[rid].token_ids == out.token_ids, rid
        assert spec[rid].finish_reason == out.finish_reason
        assert torch.allclose(torch.tensor(spec[rid].logprobs), torch.tensor(out.logprobs), atol=1e-5)
    c = engine.metrics.counters
    assert c.num_tree_nodes == sum(n for n, _ in drafter.paths)
    assert c.num_accepted_tokens == sum(a for _, a in drafter.paths + drafter.linear)
    assert not drafter.generated


def test_trees_with_accepted_branches_take_fewer_steps(model):
    """Trees that hold the true continuation (behind wrong siblings) are accepted deep,
    branches other than the first included: fewer steps than plain decoding."""
    reqs = sampled_requests(1.0, 5)
    plain_engine = _engine_with(model, reqs, speculative=False)
    plain = run_to_end(plain_engine)

    drafter = TreeOracleDrafter({rid: o.token_ids for rid, o in plain.items()}, 5, true_last=True)
    drafter.rng.randrange = lambda a, b=None: (b - 1) if b is not None else a - 1  # longest truth, most wrongs
    engine = _engine_with(model, reqs, drafter=drafter, max_draft_len=6)
    spec = run_to_end(engine)
    assert {r: o.token_ids for r, o in spec.items()} == {r: o.token_ids for r, o in plain.items()}
    c = engine.metrics.counters
    assert c.num_tree_drafts > 0 and c.num_accepted_tokens > c.num_tree_drafts
    assert c.num_steps < plain_engine.metrics.counters.num_steps


def _kv_rows(engine, rid: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's K and V at positions 0..n-1, every layer: [layers, n, kvh, d]."""
    seq = engine.seqs[rid]
    bs = engine.block_manager.block_size
    slots = torch.tensor([seq.block_table[p // bs] * bs + p % bs for p in range(n)])
    cache = engine.runner.kv_cache
    flat = lambda pool: pool.view(pool.shape[0], -1, *pool.shape[3:])[:, slots]  # noqa: E731
    return flat(cache.k), flat(cache.v)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_kv_after_tree_steps_is_that_of_plain_decoding(model, batch_invariant):
    """After every tree step (accepted paths behind wrong siblings: their KV moved), the
    cache holds, at every committed position, the KV a plain engine computed for the same
    tokens (bitwise in batch-invariant mode)."""
    req = make_request(0, prompt_of(7), temperature=1.0, max_tokens=40, max_new_tokens=40)
    kw = dict(batch_invariant=batch_invariant)
    plain_out = plain_outputs(model, [req], **kw)
    drafter = TreeOracleDrafter({"r0": plain_out["r0"].token_ids}, 3, true_last=True)
    engine = _engine_with(model, [req], drafter=drafter, max_draft_len=6, **kw)
    plain = _engine_with(model, [req], speculative=False, overlap=False, **kw)  # (read mid-run)
    moved = 0
    while "r0" in engine.seqs:
        engine.step()
        seq = engine.seqs.get("r0")
        if seq is None:
            break
        while plain.seqs["r0"].num_computed_tokens < seq.num_computed_tokens:
            plain.step()
        n = seq.num_computed_tokens
        assert plain.seqs["r0"].token_ids[:n + 1] == seq.token_ids[:n + 1]
        (k, v), (pk, pv) = _kv_rows(engine, "r0", n), _kv_rows(plain, "r0", n)
        if batch_invariant:
            assert torch.equal(k, pk) and torch.equal(v, pv)
        else:
            torch.testing.assert_close(k, pk, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v, pv, atol=1e-5, rtol=1e-5)
        moved += 1
    assert moved > 2 and any(a > 1 for _, a in drafter.paths)


def test_batch_invariant_tree_speculation_is_bitwise(model):
    """Batch-invariant mode: tree steps give the plain run's tokens and logprobs bit for bit."""
    reqs = sampled_requests(1.0, 11)
    plain = plain_outputs(model, reqs, batch_invariant=True)
    drafter = TreeOracleDrafter({rid: o.token_ids for rid, o in plain.items()}, 11, true_last=True)
    engine = _engine_with(model, reqs, drafter=drafter, batch_invariant=True, max_draft_len=6)
    spec = run_to_end(engine)
    for rid, out in plain.items():
        assert spec[rid].token_ids == out.token_ids and spec[rid].logprobs == out.logprobs, rid
    assert engine.metrics.counters.num_tree_drafts > 0


def test_tree_steps_replay_the_verify_graphs(model):
    """With trees on, verify graphs read a static tree mask: tree steps replay the graph of
    their token count (no capture past the first ones), with the eager output."""
    reqs = sampled_requests(1.0, 21, n=4)
    plain = plain_outputs(model, reqs)
    drafter = TreeOracleDrafter({rid: o.token_ids for rid, o in plain.items()}, 21)
    engine = new_engine(model, drafter=drafter, max_num_seqs=8)
    graphs = engine.runner.graphs = EagerGraphs(engine.runner, 8, engine.max_draft_len, tree_drafts=True)
    graphs.capture_all()
    captured = set(graphs.graphs)
    replays = []
    replay = graphs.replay
    graphs.replay = lambda inputs: replays.append(inputs.metadata.tree_mask is not None) or replay(inputs)
    for r in reqs:
        engine.add_request(r)
    out = run_to_end(engine)
    assert set(graphs.graphs) == captured
    for rid, ref in plain.items():
        assert out[rid].token_ids == ref.token_ids
        assert torch.allclose(torch.tensor(out[rid].logprobs), torch.tensor(ref.logprobs), atol=1e-5)
    assert any(replays) and graphs.num_replays > 0


def test_malformed_trees_cost_speed_never_samples(model):
    """A drafter bug (a parent after its child, repeated siblings, tokens out of the vocab)
    is no draft that step: the output is plain decoding's."""
    reqs = sampled_requests(0.0, 2)
    plain = plain_outputs(model, reqs)

    class Broken(TreeOracleDrafter):
        calls = 0

        def _tree(self, rid, max_depth, max_nodes):
            Broken.calls += 1
            tokens, parents = super()._tree(rid, max_depth, max_nodes)
            kind = Broken.calls % 5
            if kind == 3 and tokens:
                return tokens, [None] + parents[1:]  # not a parent index at all
            if kind == 0 and tokens:
                return tokens + [tokens[0]], parents + [parents[0]]  # a repeated sibling
            if kind == 1 and tokens:
                return tokens, [len(tokens)] + parents[1:]  # a parent that is not before it
            if kind == 2 and tokens:
                return [VOCAB + 3] + tokens[1:], parents
            return tokens, parents

    drafter = Broken({rid: o.token_ids for rid, o in plain.items()}, 2)
    spec = run_to_end(_engine_with(model, reqs, drafter=drafter, max_draft_len=5))
    assert {r: o.token_ids for r, o in spec.items()} == {r: o.token_ids for r, o in plain.items()}


def test_depth_and_node_caps_hold(model):
    """The engine cuts a tree to the request's depth cap and the node cap: no row samples
    past max_tokens, and a step never feeds more than max_draft_len nodes per sequence."""
    reqs = [make_request(i, prompt_of(4, i), temperature=0.0, max_tokens=5, max_new_tokens=5) for i in range(2)]
    plain = plain_outputs(model, reqs)
    drafter = TreeOracleDrafter({rid: o.token_ids + [1] * 20 for rid, o in plain.items()}, 4, max_wrong=3)
    engine = _engine_with(model, reqs, drafter=drafter, max_draft_len=4)
    fed = []
    prepare = engine.runner.prepare

    def recording(seqs):
        for s in seqs:
            if s.draft_parents is not None:
                fed.append((len(s.draft_token_ids), max(depths(s.draft_parents)), s.max_new_tokens_left()))
        return prepare(seqs)

    engine.runner.prepare = recording
    spec = run_to_end(engine)
    assert {r: o.token_ids for r, o in spec.items()} == {r: o.token_ids for r, o in plain.items()}
    assert fed and all(n <= 4 and d <= left - 1 for n, d, left in fed)


def test_stop_tokens_before_min_tokens_are_masked_by_depth(model):
    """Before min_tokens a stop token is masked out of a row by the position the row
    samples (its depth), not by its index in the flat tree: the true branch sits behind
    wrong siblings (high row indices at small depths) and the output is plain decoding's."""
    import dataclasses

    from tests.rollout.engine.test_engine import reference_generate

    reqs = []
    for i in range(4):
        base = make_request(i, prompt_of(5, i), temperature=0.0, max_tokens=16, max_new_tokens=16)
        free_run = reference_generate(model, base)[0]
        k = 3 + i
        reqs.append(dataclasses.replace(base, stop_token_ids=frozenset({free_run[k]}), min_tokens=k + 3))
    plain = plain_outputs(model, reqs)
    drafter = TreeOracleDrafter({rid: o.token_ids for rid, o in plain.items()}, 9, true_last=True, max_wrong=3)
    drafter.rng.randrange = lambda a, b=None: (b - 1) if b is not None else a - 1  # whole truth, most wrongs
    spec = run_to_end(_engine_with(model, reqs, drafter=drafter, max_draft_len=8))
    for rid, out in plain.items():
        assert spec[rid].token_ids == out.token_ids and spec[rid].finish_reason == out.finish_reason, rid


class EveryTokenDrafter(TreeOracleDrafter):
    """A tree of every vocabulary token as a child of the root: the token after the
    root's sample is always drawn at a tree row (depth 1)."""

    def __init__(self, vocab: int):
        super().__init__({}, 0)
        self.vocab = vocab

    def _tree(self, rid, max_depth, max_nodes):
        n = min(self.vocab, max_nodes) if max_depth >= 1 else 0
        return list(range(n)), [-1] * n


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_tokens_sampled_at_tree_rows_follow_the_exact_distribution(temperature):
    """The statistical test at T=1 (and 0.7) through tree rows: the third token of 3,000
    seeded samples, drawn at the depth-1 node matching the second, against the exact
    softmax of an independent dense forward, for the two most frequent first pairs."""
    from collections import Counter

    from services.rollout.engine import CostModel, LLMEngine, run_to_completion
    from tests.rollout.engine.test_sampling_contract import (CHI2_999, CONFIG as SMALL, PROMPT, exact_distribution,
                                                             model_logits, request)

    small = init_random_model(SMALL, seed=3)
    with torch.no_grad():
        small.lm_head.weight.mul_(4.0)
    n = 3000
    drafter = EveryTokenDrafter(SMALL.vocab_size)
    engine = LLMEngine(small, device="cpu", num_kv_blocks=1024, block_size=8, max_num_seqs=32,
                       max_num_batched_tokens=1024, drafter=drafter, max_draft_len=SMALL.vocab_size,
                       cost_model=CostModel(tolerance=1000.0), measure_cost=False)
    outs = run_to_completion(engine, [request(i, seed=5000 + i, max_tokens=3, temperature=temperature)
                                      for i in range(n)])
    assert engine.metrics.counters.num_tree_drafts > n // 2  # most third tokens came from tree rows
    by_pair: dict[tuple[int, int], list[int]] = {}
    for o in outs.values():
        by_pair.setdefault(tuple(o.token_ids[:2]), []).append(o.token_ids[2])
    for pair, thirds in sorted(by_pair.items(), key=lambda kv: -len(kv[1]))[:2]:
        expected = exact_distribution(model_logits(small, PROMPT + list(pair))[-1], temperature, 0, 1.0)
        m, counts = len(thirds), Counter(thirds)
        big = [v for v, p in expected.items() if m * p >= 5]  # the rest pooled in one bin
        rest_p = 1.0 - sum(expected[v] for v in big)
        bins = [(counts[v], m * expected[v]) for v in big] + ([(m - sum(counts[v] for v in big), m * rest_p)]
                                                            if rest_p * m >= 5 else [])
        assert len(bins) >= 2 and m >= 200, (pair, m)
        chi2 = sum((o - e) ** 2 / e for o, e in bins)
        assert chi2 < CHI2_999[len(bins) - 1], (pair, chi2, counts, expected)
