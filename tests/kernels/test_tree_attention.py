"""Tree attention (a draft tree's verify): the Triton kernel, the PyTorch reference and the
batch-invariant reference against dense attention with the tree's mask, on ragged trees
beside plain sequences (decode, linear verify, prefill chunk).

If these fail, a tree node sees a sibling branch's token (its logits are not those of a
run without speculation: tree drafts stop being lossless) or misses an ancestor."""

import random

import pytest
import torch
import torch.nn.functional as F

from kernels import paged_attention as pa
from services.rollout.engine.tree import row_masks
from tests.kernels.test_paged_attention import DEVICE, TOLERANCE, make_batch


def random_parents(rng: random.Random, num_nodes: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(num_nodes)]


def tree_batch(seed: int):
    """Sequences with trees of 0..12 nodes (a root and its nodes; some chains, some
    bushes), a decode, a linear verify and a prefill chunk. Returns the context lengths,
    the query lengths and the per-row masks (-1: causal)."""
    rng = random.Random(seed)
    context_lens, query_lens, masks = [], [], []
    for kind in ["tree", "decode", "tree", "verify", "tree", "prefill", "tree", "tree"]:
        if kind == "tree":
            parents = random_parents(rng, rng.randrange(0, 13))
            rows = row_masks(parents)
        elif kind == "decode":
            rows = [-1]
        elif kind == "verify":
            rows = [-1] * 5
        else:
            rows = [-1] * 21
        query_lens.append(len(rows))
        context_lens.append(len(rows) + rng.randrange(0, 40))
        masks.extend(rows)
    return context_lens, query_lens, torch.tensor(masks, dtype=torch.int64)


def dense_tree_attention(q, dense, query_lens, masks, scale):
    """Per sequence with SDPA: row i sees the context before the query and the query rows
    j <= i whose bit is set in its mask."""
    num_heads = q.shape[1]
    out, start = [], 0
    for (k, v), query_len in zip(dense, query_lens):
        context_len, num_kv_heads = k.shape[:2]
        group = num_heads // num_kv_heads
        qs = q[start:start + query_len].float().transpose(0, 1)  # [h, qlen, d]
        ks = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [h, ctx, d]
        vs = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        base = context_len - query_len
        visible = torch.zeros(query_len, context_len, dtype=torch.bool)
        for i in range(query_len):
            mask = int(masks[start + i])
            visible[i, :base] = True
            for j in range(i + 1):
                visible[i, base + j] = mask == -1 or bool((mask >> j) & 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=scale)  # [h, qlen, d]
        out.append(o.transpose(0, 1))
        start += query_len
    return torch.cat(out).to(q.dtype)


PATHS = {
    "reference": lambda *a, tree_mask: pa.paged_attention_reference(*a, tree_mask=tree_mask),
    "invariant_reference": lambda *a, tree_mask: pa.paged_attention(*a, batch_invariant=True, tree_mask=tree_mask),
    "triton": lambda *a, tree_mask: pa.paged_attention_triton(*a, tree_mask=tree_mask),
    "triton_split_kv": lambda *a, tree_mask: pa.paged_attention_triton(*a, num_kv_splits=3, tree_mask=tree_mask),
    "triton_invariant": lambda *a, tree_mask: pa.paged_attention_triton(*a, batch_invariant=True,
                                                                        tree_mask=tree_mask),
}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("path", PATHS)
def test_tree_attention_matches_dense_masked_attention(path, seed):
    context_lens, query_lens, masks = tree_batch(seed)
    paged, dense = make_batch(context_lens, query_lens, 4, 2, 16, block_size=4, dtype=torch.float32,
                              device=DEVICE if path.startswith("triton") else "cpu", seed=seed)
    scale = 0.25
    expected = dense_tree_attention(paged[0].cpu(), dense, query_lens, masks, scale)
    out = PATHS[path](*paged, scale, max(query_lens), tree_mask=masks.to(paged[0].device))
    torch.testing.assert_close(out.cpu(), expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("path", ["reference", "invariant_reference", "triton"])
def test_all_causal_mask_changes_nothing(path):
    """A mask of -1 everywhere is plain causal attention: exactly the maskless result."""
    context_lens, query_lens = [30, 9, 50], [1, 6, 17]
    paged, _ = make_batch(context_lens, query_lens, 4, 2, 16, block_size=4, dtype=torch.float32,
                          device=DEVICE if path == "triton" else "cpu")
    masks = torch.full((sum(query_lens),), -1, dtype=torch.int64, device=paged[0].device)
    with_mask = PATHS[path](*paged, 0.25, 17, tree_mask=masks)
    without = PATHS[path](*paged, 0.25, 17, tree_mask=None)
    assert torch.equal(with_mask, without)


def test_invariant_tree_row_is_bitwise_a_plain_decode():
    """Batch-invariant mode: a tree node at depth d gives bit for bit the output of a plain
    decode whose context is the prefix then its ancestors, contiguous (what a run without
    speculation computes for the same tokens)."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, bs = 4, 2, 16, 4
    prefix, parents = 70, random_parents(rng, 12)
    masks = row_masks(parents)
    query_len = len(masks)
    total = prefix + query_len
    blocks = -(-total // bs)
    k_cache = torch.randn(blocks + 30, bs, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks + 30, bs, kv_heads, dim, generator=gen)
    table = torch.randperm(blocks + 30, generator=gen)[:blocks].to(torch.int32)[None, :]
    q = torch.randn(query_len, heads, dim, generator=gen)
    cu = torch.tensor([0, query_len], dtype=torch.int32)
    tree_out = pa.paged_attention(q, k_cache, v_cache, table, torch.tensor([total], dtype=torch.int32), cu, 0.25,
                                  query_len, batch_invariant=True,
                                  tree_mask=torch.tensor(masks, dtype=torch.int64))
    k_flat, v_flat = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    slot = lambda p: int(table[0, p // bs]) * bs + p % bs  # noqa: E731
    for row, mask in enumerate(masks):
        chain = [j for j in range(row + 1) if (mask >> j) & 1]  # the ancestors' query rows, in order
        positions = list(range(prefix)) + [prefix + j for j in chain]  # the query starts at `prefix`
        n = len(positions)
        lin_blocks = -(-n // bs)
        lin_k = torch.zeros(lin_blocks, bs, kv_heads, dim)
        lin_v = torch.zeros(lin_blocks, bs, kv_heads, dim)
        lin_k.view(-1, kv_heads, dim)[:n] = k_flat[[slot(p) for p in positions]]
        lin_v.view(-1, kv_heads, dim)[:n] = v_flat[[slot(p) for p in positions]]
        plain = pa.paged_attention(q[row:row + 1], lin_k, lin_v, torch.arange(lin_blocks, dtype=torch.int32)[None, :],
                                   torch.tensor([n], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                                   0.25, 1, batch_invariant=True)
        assert torch.equal(plain[0], tree_out[row]), row
