"""The tree verifier (engine/tree.py, verifier.tree_verdict) on its own, table-driven like
test_verifier.py: a flattened tree and the target's token at each row -> the committed
tokens; a chain gives exactly the linear verdict; at T=1 every committed token is the one
a plain run draws at its position (rows are keyed by depth, not by row).

If these fail, tree speculation commits tokens a run without speculation would not."""

import random

import pytest
import torch

from services.rollout.engine import tree
from services.rollout.engine.verifier import verify
from tests.rollout.engine.test_verifier import VOCAB, _logits, _seq

#        root
#      /  |   \
#    5(0) 7(1) 9(2)        node indices in parentheses
#    |     |
#   6(3)  8(4)
#    |
#   2(5)
BUSH = ([5, 7, 9, 6, 8, 2], [-1, -1, -1, 0, 1, 3])

# (tree, target argmax per row (row 0 the root, row i + 1 node i), committed tokens, accepted path)
TABLE = [
    (BUSH, [5, 6, 8, 0, 2, 0, 4], [5, 6, 2, 4], [0, 3, 5]),  # the deepest branch, then the bonus token
    (BUSH, [7, 6, 8, 0, 2, 0, 4], [7, 8, 0], [1, 4]),  # the second branch, recovered token after it
    (BUSH, [9, 1, 1, 3, 1, 1, 1], [9, 3], [2]),  # a leaf: its own sample is the bonus token
    (BUSH, [4, 6, 8, 0, 2, 0, 4], [4], []),  # no child matches: only the recovered token
    (BUSH, [5, 3, 8, 0, 2, 0, 4], [5, 3], [0]),  # 5 accepted, its child 6 rejected
    (([], []), [3], [3], None),  # no draft at all: a plain decode's verdict
    (([4, 4], [-1, 0]), [4, 4, 1], [4, 4, 1], [0, 1]),  # a chain with a repeated token
]


@pytest.mark.parametrize("draft,argmax,expected,path", TABLE)
def test_tree_table(draft, argmax, expected, path):
    tokens, parents = draft
    seq = _seq(tokens)
    seq.draft_parents = list(parents)
    [verdict] = verify(_logits(argmax), [seq])
    assert verdict.token_ids == expected
    assert verdict.path == path
    assert (verdict.num_draft, verdict.num_accepted) == (len(tokens), len(path or []))
    assert len(verdict.logprobs) == len(expected)


@pytest.mark.parametrize("seed", range(20))
def test_a_chain_verifies_as_a_linear_draft(seed):
    """A tree that is a chain: the same tokens, logprobs and counts as the linear draft."""
    rng = random.Random(seed)
    k = rng.randrange(0, 7)
    draft = [rng.randrange(VOCAB) for _ in range(k)]
    argmax = [t if rng.random() < 0.7 else rng.randrange(VOCAB) for t in draft] + [rng.randrange(VOCAB)]
    linear, chain = _seq(draft), _seq(draft)
    chain.draft_parents = list(range(-1, k - 1))
    [a] = verify(_logits(argmax), [linear])
    [b] = verify(_logits(argmax), [chain])
    assert (a.token_ids, a.logprobs, a.num_draft, a.num_accepted) == (b.token_ids, b.logprobs, b.num_draft,
                                                                      b.num_accepted)
    assert b.path == (list(range(b.num_accepted)) if k else None)


def test_trees_and_linear_drafts_in_one_batch():
    seqs = [_seq([5, 6]), _seq(BUSH[0]), _seq([])]
    seqs[1].draft_parents = list(BUSH[1])
    argmax = [5, 1, 9] + [7, 6, 8, 0, 2, 0, 4] + [3]
    verdicts = verify(_logits(argmax), seqs)
    assert [v.token_ids for v in verdicts] == [[5, 1], [7, 8, 0], [3]]
    assert [v.path for v in verdicts] == [None, [1, 4], None]


def test_sampled_tree_commits_what_a_plain_run_draws():
    """T=1: a row's draw is keyed on (seed, L + its depth), so the branch equal to the plain
    run's draws is accepted whole wherever it sits in the tree, and its siblings' rows (same
    depths, other logits) do not change the committed tokens."""
    gen = torch.Generator().manual_seed(0)
    depth_logits = torch.randn(4, VOCAB, generator=gen)  # the logits a plain run sees at depths 0..3
    prompt = [1, 2, 3]
    plain = []
    for d in range(4):
        [v] = verify(depth_logits[d:d + 1], [_seq([], 1.0, tuple(prompt + plain))])
        plain.append(v.token_ids[0])
    wrong = [(t + 1) % VOCAB for t in plain]
    # nodes: 0 wrong[0] | 1 plain[0] | 2 wrong[1] under 1 | 3 plain[1] under 1 | 4 plain[2] under 3
    tokens, parents = [wrong[0], plain[0], wrong[1], plain[1], plain[2]], [-1, -1, 1, 1, 3]
    node_depth = [0] + tree.depths(parents)
    rows = torch.stack([depth_logits[d] for d in node_depth])  # each row sees its path's context
    rows[1] = torch.randn(VOCAB, generator=gen)  # the wrong branch's rows: any logits
    rows[3] = torch.randn(VOCAB, generator=gen)
    seq = _seq(tokens, 1.0, tuple(prompt))
    seq.draft_parents = parents
    [verdict] = verify(rows, [seq])
    assert verdict.token_ids == plain and verdict.path == [1, 3, 4]


# ------------------------------------------------------------------ tree helpers

def test_row_masks_are_ancestors_and_self():
    masks = tree.row_masks(BUSH[1])
    assert masks == [0b1, 0b11, 0b101, 0b1001, 0b10011, 0b100101, 0b1010011]
    assert tree.row_masks([-1, 0], num_fed=3) == [0b1, 0b11, 0b111, 0b1111, 0b11111]
    with pytest.raises(ValueError, match="draft_token_ids"):
        tree.row_masks([-1] * 63)


def test_prune_depth_and_node_count():
    tokens, parents = BUSH
    assert tree.prune(tokens, parents, 1, 10) == ([5, 7, 9], [-1, -1, -1])
    assert tree.prune(tokens, parents, 2, 10) == ([5, 7, 9, 6, 8], [-1, -1, -1, 0, 1])
    assert tree.prune(tokens, parents, 9, 4) == ([5, 7, 9, 6], [-1, -1, -1, 0])
    assert tree.shape(parents) == (3, 3)


def test_kv_moves_place_the_path_at_consecutive_offsets():
    assert tree.kv_moves([0, 1, 2], 10) == []  # a chain's accepted prefix is in place
    assert tree.kv_moves([1, 4], 10) == [(12, 11), (15, 12)]
    assert tree.kv_moves([0, 3, 5], 10) == [(14, 12), (16, 13)]


@pytest.mark.parametrize("tokens,parents,field", [
    ([1, 2], [-1], "draft_parents"), ([1, 2], [-1, 1], "draft_parents"), ([1, 1], [-1, -1], "draft_token_ids")])
def test_bad_trees_name_the_field(tokens, parents, field):
    with pytest.raises(ValueError, match=field):
        tree.check_tree(tokens, parents)
