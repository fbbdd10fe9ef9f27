"""Random drafter lifecycles, run on two drafters side by side (the compiled core and the
Python reference): everything either one returns goes in a trace, and the traces must be
equal. Small vocabularies and bounds, so that matches, ties, back-offs, evictions, global
flips, aborts and resumed chunks all happen within a few dozen operations. Steps draft
linear drafts (`propose`) or trees (`propose_trees`, on or off in the config, wide or
narrow, cut to random node caps and budgets), and a tree's verdict is a random root-to-leaf
path (`record_tree_acceptance`). Verdicts and tokens come one call at a time (staged by the
compiled drafter) or as an engine step's `commit_step` for several requests at once,
after calls still staged.

Also runnable as a script (the sanitizer test runs it in a subprocess):
    python -m tests.rollout.drafter.parity_ops SEED_FROM SEED_TO
"""

from __future__ import annotations

import random
import sys

from services.rollout.drafter import DrafterConfig, HistoDrafter
from services.rollout.engine.cost_model import CostModel


def random_config(rng: random.Random) -> DrafterConfig:
    return DrafterConfig(
        use_history=rng.random() < 0.9, use_siblings=rng.random() < 0.85, use_prompt=rng.random() < 0.85,
        use_global=rng.random() < 0.85,
        max_tokens_per_prompt=rng.choice([16, 40, 96, 65536]), history_fraction=rng.choice([0.5, 0.75, 1.0]),
        global_max_tokens=rng.choice([16, 48, 128, 262144]),
        recency_decay=rng.choice([0.7, 0.5]), reward_weighting=rng.random() < 0.3,
        sibling_weight=rng.choice([1.5, 1.0]), prompt_weight=rng.choice([0.5, 1.0]),
        smoothing=rng.choice([0.3, 0.0, 1.0]), backoff_weight=rng.choice([2.0, 0.5]),
        match_len_prior=rng.choice([1.0, 3.0]), global_match_len_prior=rng.choice([1.0, 4.0]),
        min_match_len=rng.choice([1, 1, 2, 3]), min_gain=rng.choice([0.1, 0.0, 0.3]),
        max_draft_len=rng.choice([16, 4, 1]),
        cost_model=rng.choice([CostModel(), CostModel(measure=True, min_samples=1)]) if rng.random() < 0.3 else None,
        tree=rng.random() < 0.75, tree_width=rng.choice([1, 2, 3, 3, 5]), tree_max_batch=rng.choice([16, 16, 2, 0]),
        tree_min_gain=rng.choice([None, 0.15, 0.0, 0.0, 0.05]))


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    # repetitive text: copies of earlier spans, so contexts recur
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.5:
            start = rng.randrange(len(out))
            out.extend(out[start:start + rng.randint(1, 6)])
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


def _random_path(rng: random.Random, parents: list[int]) -> list[int]:
    """A random accepted path of a tree (node indices, root to leaf), as a verifier picks one."""
    path: list[int] = []
    while rng.random() < 0.8:
        children = [i for i, p in enumerate(parents) if p == (path[-1] if path else -1)]
        if not children:
            break
        path.append(rng.choice(children))
    return path


def run(drafter, seed: int, num_ops: int = 60) -> list:
    """Drives `drafter` through a random lifecycle; returns what it answered."""
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 12, 50])
    prompts = [f"p{i}" for i in range(rng.randint(1, 3))]
    prompt_text = {p: _tokens(rng, vocab, rng.randint(0, 12)) for p in prompts}
    running: dict[str, tuple[list[int], list[int] | None]] = {}  # request -> its last draft (tokens, parents)
    trace: list = []
    next_req = 0
    for _ in range(num_ops):
        op = rng.random()
        if op < 0.08:
            p = rng.choice(prompts)
            responses = [_tokens(rng, vocab, rng.randint(0, 20)) for _ in range(rng.randint(0, 5))]
            ages = [rng.randint(0, 3) for _ in responses]
            rewards = [rng.choice([0.0, 1.0, 0.5]) for _ in responses]
            drafter.load_history(p, responses, epoch_ages=ages, rewards=rewards)
        elif op < 0.14:
            drafter.add_global_responses([_tokens(rng, vocab, rng.randint(0, 25)) for _ in range(rng.randint(1, 3))])
        elif op < 0.26 or not running:
            p = rng.choice(prompts)
            rid = f"r{next_req}"
            next_req += 1
            resumed = _tokens(rng, vocab, rng.randint(0, 15)) if rng.random() < 0.3 else []
            drafter.start_request(rid, p, prompt_text[p], resumed)
            running[rid] = ([], None)
        elif op < 0.34:
            rid = rng.choice(sorted(running))
            drafter.stop_request(rid)  # a finished chunk or an abort
            del running[rid]
            if rng.random() < 0.5:  # its response reaches the global index, as the worker's feed does
                drafter.add_global_responses([_tokens(rng, vocab, rng.randint(0, 10))])
        elif op < 0.38:
            drafter.release_prompt(rng.choice(prompts))
        elif op < 0.70:
            rids = rng.sample(sorted(running), rng.randint(1, len(running)))
            max_lens = [rng.choice([0, 1, 3, 16, 30]) for _ in rids]
            stops = [frozenset(rng.sample(range(vocab), rng.randint(0, 2))) for _ in rids] \
                if rng.random() < 0.5 else None
            budget = rng.choice([None, None, 0, 1, 3, 8, 40])
            num_seqs = rng.choice([None, 1, 64, 256])
            if rng.random() < 0.5:
                max_nodes = rng.choice([0, 1, 4, 16, 40, -1])
                trees = drafter.propose_trees(rids, max_lens, stop_token_ids=stops, budget=budget,
                                              max_nodes=max_nodes, num_seqs=rng.choice([num_seqs, None, 2]))
                trace.append(("propose_trees", trees))
            else:
                trees = [(d, None) for d in drafter.propose(rids, max_lens, stop_token_ids=stops, budget=budget,
                                                            num_seqs=num_seqs)]
                trace.append(("propose", trees))
            for rid, tree in zip(rids, trees):
                running[rid] = tree
        elif op < 0.85:
            rid = rng.choice(sorted(running))
            draft, parents = running[rid]
            if draft and parents is not None:
                path = _random_path(rng, parents)
                drafter.record_tree_acceptance(rid, parents, path)
                committed = [draft[i] for i in path] + [rng.randrange(vocab)]
                running[rid] = ([], None)
            elif draft:
                accepted = rng.randint(0, len(draft))
                drafter.record_acceptance(rid, len(draft), accepted)
                committed = draft[:accepted] + [rng.randrange(vocab)]
                running[rid] = ([], None)
            else:
                committed = _tokens(rng, vocab, rng.randint(1, 4))
            drafter.add_tokens(rid, committed)
        else:  # an engine step's commits in one commit_step (trees' verdicts staged one by one first)
            rids = rng.sample(sorted(running), rng.randint(1, len(running)))
            num_draft, num_accepted, tokens, counts = [], [], [], []
            for rid in rids:
                draft, parents = running[rid]
                accepted = 0
                if draft and parents is not None:
                    path = _random_path(rng, parents)
                    drafter.record_tree_acceptance(rid, parents, path)
                    committed = [draft[i] for i in path] + [rng.randrange(vocab)]
                    draft = []
                elif draft:
                    accepted = rng.randint(0, len(draft))
                    committed = draft[:accepted] + [rng.randrange(vocab)]
                else:
                    committed = _tokens(rng, vocab, rng.randint(0, 4))
                if rng.random() < 0.15:  # a request that ended: its verdict, no tokens
                    committed = None
                num_draft.append(len(draft))
                num_accepted.append(accepted)
                counts.append(-1 if committed is None else len(committed))
                tokens += committed or []
                running[rid] = ([], None)
            drafter.commit_step(rids, num_draft, num_accepted, tokens, counts)
        if rng.random() < 0.15:  # the engine's step times reach its cost model (a measuring one changes its curve)
            drafter.config.cost_model and drafter.config.cost_model.observe(rng.choice([1, 8, 30, 64, 256]),
                                                                            rng.uniform(0.5, 8.0))
        if rng.random() < 0.1:
            stats = drafter.stats()
            trace.append(("stats", stats, [drafter.memory_tokens(p) for p in prompts],
                          [drafter.has_prompt(p) for p in prompts], drafter.global_tokens()))
    trace.append(("end", drafter.stats()))
    return trace


def compare(seed: int, make_compiled, num_ops: int = 60) -> None:
    """Asserts that the compiled drafter and the reference answer alike for one seed."""
    # a config each (equal): a measuring cost model is changed by the run that uses it
    expected = run(HistoDrafter(random_config(random.Random(seed))), seed, num_ops)
    got = run(make_compiled(random_config(random.Random(seed))), seed, num_ops)
    assert len(got) == len(expected), f"seed {seed}: {len(got)} answers, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"seed {seed}, answer {i}: {g} != {e}"


def _hub_text(rng: random.Random, hubs: list[int], vocab: int, n: int) -> list[int]:
    """Text where each hub token is followed by one of many tokens: the contexts ending in
    a hub have tens of continuations (the core keeps such states' scans: ScanCache)."""
    out: list[int] = []
    while len(out) < n:
        out += [rng.choice(hubs), rng.randrange(len(hubs), vocab)]
        if rng.random() < 0.3:
            out.append(rng.randrange(len(hubs), vocab))
    return out[:n]


def run_wide(drafter, seed: int, num_steps: int = 14) -> list:
    """Siblings of one prompt drafting together, step after step, from histories, a prompt
    and a global index whose hub contexts have many continuations; each step's commits
    (some tokens accepted, hubs among the new ones) change those continuations' weights
    before the next. Returns what the drafter answered."""
    rng = random.Random(seed)
    hubs = [0, 1, 2][:rng.randint(1, 3)]
    vocab = rng.choice([60, 300, 2000])
    text = lambda n: _hub_text(rng, hubs, vocab, n)  # noqa: E731
    for p in ("p0", "p1"):
        responses = [text(rng.randint(4, 40)) for _ in range(rng.randint(10, 40))]
        drafter.load_history(p, responses, epoch_ages=[rng.randint(0, 2) for _ in responses],
                             rewards=[rng.choice([0.0, 0.5, 1.0]) for _ in responses])
    drafter.add_global_responses([text(rng.randint(4, 40)) for _ in range(rng.randint(0, 40))])
    running = {}
    for i in range(rng.randint(2, 8)):
        rid = f"r{i}"
        drafter.start_request(rid, rng.choice(["p0", "p1"]), text(rng.randint(0, 10)),
                              text(rng.randint(0, 6)) + [rng.choice(hubs)])
        running[rid] = []
    trace: list = []
    for _ in range(num_steps):
        rids = sorted(running)
        drafts = drafter.propose(rids, [16] * len(rids), budget=rng.choice([None, None, 4, 12]),
                                 num_seqs=rng.choice([None, 64]))
        trace.append(drafts)
        num_accepted, tokens, counts = [], [], []
        for draft in drafts:
            accepted = rng.randint(0, len(draft))
            committed = draft[:accepted] + [rng.choice(hubs) if rng.random() < 0.5 else rng.randrange(vocab)]
            num_accepted.append(accepted)
            tokens += committed
            counts.append(len(committed))
        drafter.commit_step(rids, [len(d) for d in drafts], num_accepted, tokens, counts)
    trace.append(("end", drafter.stats()))
    return trace


def compare_wide(seed: int, make_compiled) -> None:
    """run_wide on the reference and on the compiled drafter: the same answers."""
    config = DrafterConfig(min_match_len=1, cost_model=CostModel())
    expected = run_wide(HistoDrafter(config), seed)
    got = run_wide(make_compiled(config), seed)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"seed {seed}, step {i}: {g} != {e}"


if __name__ == "__main__":
    from services.rollout.drafter.compiled import CompiledDrafter

    lo, hi = int(sys.argv[1]), int(sys.argv[2])
    for s in range(lo, hi):
        compare(s, lambda c: CompiledDrafter(c, max_slots=64))
        compare_wide(s, lambda c: CompiledDrafter(c, max_slots=64))
    print(f"parity ok for seeds {lo}..{hi - 1}")
