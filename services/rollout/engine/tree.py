"""Draft trees: several continuations of one sequence verified in one forward.

A tree is flattened in topological order: node i has a token ``tokens[i]`` and a parent
``parents[i]`` (-1: the root, i.e. the sequence's last token; else an earlier node,
``parents[i] < i``). A linear draft is the chain ``parents = [-1, 0, 1, ...]``.

In the step's flat batch a tree sequence feeds its last token (row 0, the root) and then
its nodes (row i + 1 for node i). Every row samples the token that follows it: row r at
depth d (the root has depth 0) samples the token at position L + d (L = the sequence's
length), keyed on (seed, L + d), and its RoPE position is L - 1 + d. Each row attends to
the committed tokens and to its ancestors only (``row_masks``). The verifier walks from
the root and follows the child whose token equals the row's sampled token
(``accept_path``): the committed tokens are exactly those a run without speculation
samples, whatever the tree.

After the step the accepted path's rows r_1 < r_2 < ... < r_a hold the KV of the tokens
at positions L .. L + a - 1 (their RoPE positions already are those): ``kv_moves`` gives
the cache rows to copy them into; the other nodes' slots are released with the rejected
tail. This module is pure: lists in, lists out.
"""

from __future__ import annotations

MAX_TREE_ROWS = 63  # a sequence's query rows a tree step can mask (bits of an int64, sign bit unused)
CAUSAL = -1  # the row mask of a row that sees every earlier row of its query (all bits set)


def check_tree(tokens: list[int], parents: list[int]) -> None:
    """Raises ValueError naming the field when (tokens, parents) is not a flattened tree
    in topological order with distinct tokens among siblings."""
    if len(tokens) != len(parents):
        raise ValueError(f"draft_parents: {len(parents)} parents for {len(tokens)} tokens")
    seen: set[tuple[int, int]] = set()
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        if not -1 <= parent < i:
            raise ValueError(f"draft_parents: node {i}'s parent {parent} is not in [-1, {i})")
        if (parent, token) in seen:
            raise ValueError(f"draft_token_ids: node {i} repeats a sibling's token {token}")
        seen.add((parent, token))


def is_chain(parents: list[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (a child of the root: 1)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def accept_path(tokens: list[int], parents: list[int], sampled: list[int]) -> list[int]:
    """The accepted nodes, root to leaf: from the root, the child whose token equals the
    token sampled at the current row, as long as there is one.

    Args:
        tokens, parents: the tree.
        sampled: the token sampled at each row (row 0 the root, row i + 1 node i).
    """
    children: dict[tuple[int, int], int] = {}
    for i, (token, parent) in enumerate(zip(tokens, parents)):
        children.setdefault((parent, token), i)
    path: list[int] = []
    node = -1
    while True:
        child = children.get((node, sampled[node + 1]))
        if child is None:
            return path
        path.append(child)
        node = child


def row_masks(parents: list[int], num_fed: int = 1) -> list[int]:
    """Per query row of a tree sequence (``num_fed`` fed tokens, the last one the root,
    then the nodes): the bitmask of the rows of its query it may see (bit j: row j), its
    ancestors and itself; the fed tokens see each other causally."""
    masks = [(1 << (j + 1)) - 1 for j in range(num_fed)]
    root = num_fed - 1
    for i, p in enumerate(parents):
        masks.append(masks[root + 1 + p] | (1 << (num_fed + i)))
    if len(masks) > MAX_TREE_ROWS:
        raise ValueError(f"draft_token_ids: a tree step holds at most {MAX_TREE_ROWS} rows, got {len(masks)}")
    return masks


def prune(tokens: list[int], parents: list[int], max_depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
    """The tree without nodes deeper than ``max_depth`` (and their subtrees), then cut to
    its first ``max_nodes`` nodes (a prefix of a topological order is a tree)."""
    keep: list[int] = []
    new_index = {-1: -1}
    for i, d in enumerate(depths(parents)):
        if d <= max_depth and parents[i] in new_index and len(keep) < max_nodes:
            new_index[i] = len(keep)
            keep.append(i)
    return [tokens[i] for i in keep], [new_index[parents[i]] for i in keep]


def kv_moves(path: list[int], first_row_offset: int) -> list[tuple[int, int]]:
    """(from, to) sequence offsets of the accepted nodes' KV: node i sits at offset
    ``first_row_offset + 1 + i`` (the root at ``first_row_offset``), and the k-th node of
    the path (k = 1, 2, ...) belongs at ``first_row_offset + k``. Only the moves that
    change something; applied all at once (sources read before any write)."""
    return [(first_row_offset + 1 + node, first_row_offset + k)
            for k, node in enumerate(path, start=1) if node + 1 != k]


def shape(parents: list[int]) -> tuple[int, int]:
    """(width, depth): the most nodes at one depth, the deepest node's depth."""
    if not parents:
        return 0, 0
    ds = depths(parents)
    counts: dict[int, int] = {}
    for d in ds:
        counts[d] = counts.get(d, 0) + 1
    return max(counts.values()), max(ds)
