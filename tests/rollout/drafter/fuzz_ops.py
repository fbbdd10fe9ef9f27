"""Hostile calls straight into the compiled drafter's C interface (no Python wrapper in
between). Arrays and their lengths agree (a C interface cannot check a pointer); the
values are hostile: slots out of range or not running, negative counts, null arrays with counts,
token ids outside [0, 2^31 - 1), decreasing offsets, bad commit rows (draft or token counts
below -1, counts that do not add up to the tokens given), NaN gains,
absurd budgets, a prompt of 100k tokens, tree steps with absurd node caps and widths or
before their buffers are bound. Every call must return 0 or an error code (never
crash, never corrupt: legal calls in between keep working and ASan stays quiet).

    python -m tests.rollout.drafter.fuzz_ops SEED_FROM SEED_TO   (the sanitizer test runs it)
"""

from __future__ import annotations

import ctypes
import random
import sys

import numpy as np

from services.rollout.drafter.compiled import ABI_VERSION, load_library

SLOTS = 8
K = 16  # max_draft_len
TREE_NODES = 3 * K  # the tree buffers' nodes per tree (width 3)
RC_OK, RC_INVAL = 0, -1


def _i32(values) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64).astype(np.int32))


def _ptr(arr: np.ndarray | None) -> int:
    return 0 if arr is None else arr.ctypes.data


def make(lib) -> tuple[int, ctypes.Array]:
    stats = (ctypes.c_double * 6)()
    ci = (ctypes.c_int64 * 11)(1, 1, 1, 1, 256, 192, 256, 1, K, 0, SLOTS)
    cd = (ctypes.c_double * 6)(1.5, 0.5, 0.3, 2.0, 1.0, 1.0)
    handle = lib.rhd_create(ci, 11, cd, 6, stats)
    assert handle
    return handle, stats


def fuzz(seed: int, num_calls: int = 300) -> dict[int, int]:
    """Runs random hostile and legal calls; returns how often each return code came back."""
    lib = load_library()
    assert lib.rhd_abi_version() == ABI_VERSION
    rng = random.Random(seed)
    h, _stats = make(lib)  # (_stats: kept alive, the core writes into it)
    running: set[int] = set()
    codes: dict[int, int] = {}
    bad_tokens = [-1, -2**31, 2**31 - 1, -7]
    out_tokens = np.zeros(SLOTS * 4 * K, dtype=np.int32)
    out_gains = np.zeros(SLOTS * 4 * K, dtype=np.float64)
    out_lens = np.zeros(SLOTS * 4, dtype=np.int32)
    # the batched step's buffers (rhd_bind): params for SLOTS requests, drafts, offsets
    params = np.zeros(4 + 2 * SLOTS, dtype=np.int64)
    step_tokens = np.zeros(SLOTS * K, dtype=np.int32)
    step_gains = np.zeros(SLOTS * K, dtype=np.float64)
    step_offsets = np.zeros(SLOTS + 1, dtype=np.int32)
    assert lib.rhd_step(h) == RC_INVAL  # nothing bound yet
    assert lib.rhd_bind(h, _ptr(params), SLOTS + 1, _ptr(step_tokens), _ptr(step_gains), _ptr(step_offsets)) \
        == RC_INVAL  # a capacity past the drafter's slots
    assert lib.rhd_bind(h, _ptr(params), SLOTS, _ptr(step_tokens), _ptr(step_gains), _ptr(step_offsets)) == RC_OK
    # the commits' block (rhd_bind_commit): n, the five columns' addresses, the token count
    commit_block = np.zeros(7, dtype=np.int64)
    assert lib.rhd_commit_bound(h) == RC_INVAL  # nothing bound yet
    assert lib.rhd_bind_commit(h, None) == RC_INVAL
    assert lib.rhd_bind_commit(h, _ptr(commit_block)) == RC_OK
    # the tree step's buffers (rhd_bind_trees): SLOTS trees of TREE_NODES nodes
    tree_tokens = np.zeros(SLOTS * TREE_NODES, dtype=np.int32)
    tree_gains = np.zeros(SLOTS * TREE_NODES, dtype=np.float64)
    tree_parents = np.zeros(SLOTS * TREE_NODES, dtype=np.int32)
    tree_offsets = np.zeros(SLOTS + 1, dtype=np.int32)
    tree_bufs = (_ptr(tree_tokens), _ptr(tree_gains), _ptr(tree_parents), _ptr(tree_offsets))
    assert lib.rhd_step_trees(h, 8, 3) == RC_INVAL  # no tree buffers bound yet
    for rows, nodes in ((SLOTS + 1, TREE_NODES), (SLOTS, 0), (SLOTS, 2**40), (-1, 4)):
        assert lib.rhd_bind_trees(h, rows, nodes, *tree_bufs) == RC_INVAL
    assert lib.rhd_bind_trees(h, SLOTS, TREE_NODES, *tree_bufs) == RC_OK

    def tokens(n: int, hostile: bool) -> np.ndarray:
        vals = [rng.randrange(6) for _ in range(n)]
        if hostile and n:
            vals[rng.randrange(n)] = rng.choice(bad_tokens)
        return _i32(vals)

    def packed(resp: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """Responses as the C ABI takes them: tokens end to end (never an empty buffer) and
        their offsets; unchecked, unlike compiled._flatten, so hostile tokens reach the core."""
        flat = _i32(np.concatenate(resp).tolist() if resp else [0])
        return flat, np.asarray([0] + np.cumsum([r.size for r in resp]).tolist(), dtype=np.int64)

    def slot(hostile: bool) -> int:
        if hostile:
            return rng.choice([-1, SLOTS, 2**31 - 1, -2**31, rng.randrange(SLOTS)])
        return rng.choice(sorted(running)) if running else 0

    def write_params(n: int, hostile: bool) -> None:
        slots = [slot(hostile and rng.random() < 0.3) for _ in range(max(0, min(n, SLOTS)))]
        lens = [rng.choice([0, 3, 16, -5, 2**62]) for _ in slots]
        gain = rng.choice([0.1, 0.0, float("nan"), float("inf"), -1.0]) if hostile else 0.1
        params[:] = 0
        params[:4] = [n, rng.choice([-2**63, -1, 0, 3, 2**62, 2**63 - 1]),
                      np.float64(gain).view(np.int64), rng.choice([0, 1, 256, -3, 2**40]) if hostile else 0]
        params[4:4 + len(slots)] = slots
        params[4 + len(slots):4 + 2 * len(slots)] = lens

    for _ in range(num_calls):
        hostile = rng.random() < 0.5
        op = rng.randrange(12)
        if op == 0:  # start
            s = slot(hostile) if hostile else rng.randrange(SLOTS)
            n = rng.choice([0, 3, 100_000]) if hostile else rng.randrange(8)
            p = tokens(n, hostile and rng.random() < 0.5)
            g = tokens(rng.randrange(5), hostile and rng.random() < 0.5)
            rc = lib.rhd_start(h, s, rng.choice([1, 2, -5, 2**62]), _ptr(p), p.size, _ptr(g), g.size)
            if rc == RC_OK:
                running.add(s)
        elif op == 1:  # stop
            s = slot(hostile)
            rc = lib.rhd_stop(h, s)
            if rc >= 0:
                running.discard(s)
        elif op == 2:  # commit: one row per request (slot, draft, accepted, token count), tokens back to back
            rows, toks = [], []
            for _ in range(rng.randint(0, 4)):
                count = rng.choice([-1, 0, 1, 3]) if not hostile else rng.choice([-1, 0, 3, -2, 2**31 - 1, -2**31])
                t = tokens(max(0, min(count, 3)), hostile and rng.random() < 0.3).tolist()
                toks += t
                draft = rng.choice([-1, 0, 2, 5]) if not hostile else rng.choice([-1, 0, 5, -2, -2**31])
                rows.append([slot(hostile and rng.random() < 0.3), draft,
                             rng.randint(-2, 5) if hostile else rng.randint(0, 5), count])
            if not hostile:  # the counts add up to the tokens given
                toks = toks[:sum(max(0, r[3]) for r in rows)]
            cols = [_i32([r[c] for r in rows] or [0]) for c in range(4)]
            t = _i32(toks or [0])
            n = len(rows) if not hostile else rng.choice([len(rows), -1, len(rows)])
            if rng.random() < 0.5:
                rc = lib.rhd_commit(h, n, *map(_ptr, cols), _ptr(t), len(toks))
            else:  # the same through the bound block (an n past int32 too)
                n = n if not hostile or rng.random() < 0.8 else rng.choice([2**31, 2**40, -2**63])
                commit_block[:] = [n, *map(_ptr, cols), _ptr(t), len(toks)]
                rc = lib.rhd_commit_bound(h)
        elif op == 3:  # propose
            n = rng.randint(0, 2 * SLOTS if hostile else len(running))
            ids = _i32([slot(hostile and rng.random() < 0.3) for _ in range(n)] or [0])
            lens = np.asarray([rng.choice([0, 3, 16, -5, 2**62]) for _ in range(max(n, 1))], dtype=np.int64)
            budget = rng.choice([-1, 0, 3, 2**62, -2**62])
            gain = rng.choice([0.1, 0.0, float("nan"), float("inf"), -1.0]) if hostile else 0.1
            rc = lib.rhd_propose(h, n, _ptr(ids), _ptr(lens), budget, gain, _ptr(out_tokens), _ptr(out_gains),
                                 _ptr(out_lens))
            if rc == RC_OK:
                assert all(0 <= x <= K for x in out_lens[:n].tolist())
        elif op == 4:  # history
            num = rng.randint(0, 3)
            flat, offsets = packed([tokens(rng.randrange(10), hostile and rng.random() < 0.3) for _ in range(num)])
            if hostile and num:
                offsets[rng.randrange(1, num + 1)] = rng.choice([-1, 0])  # decreasing (within the array)
            ages = _i32([rng.choice([0, 1, -1]) if hostile else rng.randint(0, 3) for _ in range(max(num, 1))])
            weights = np.asarray([rng.choice([1.0, float("nan"), -1.0]) if hostile else 1.0
                                  for _ in range(max(num, 1))])
            rc = lib.rhd_load_history(h, rng.choice([1, 2]), _ptr(flat), _ptr(offsets), num, _ptr(ages), _ptr(weights))
        elif op == 5:  # global
            num = rng.randint(0, 3)
            flat, offsets = packed([tokens(rng.randrange(12), hostile and rng.random() < 0.3) for _ in range(num)])
            if hostile and num:
                offsets[0] = rng.choice([0, 1, -1])
            rc = lib.rhd_add_global(h, _ptr(flat), _ptr(offsets), num)
        elif op == 6 and rng.random() < 0.5:  # stop tokens, one slot
            st = _i32([rng.randrange(6) for _ in range(rng.randrange(3))] or [0])
            rc = lib.rhd_set_stops(h, slot(hostile), _ptr(st), rng.choice([0, 1, -1]) if hostile else 1)
        elif op == 6:  # stop tokens, several slots in one call (bad slots, offsets, counts, nulls)
            num = rng.randint(0, 3)
            flat, offsets = packed([tokens(rng.randrange(3), False) for _ in range(num)])
            slots = _i32([slot(hostile and rng.random() < 0.4) for _ in range(num)] or [0])
            n = num
            if hostile:
                kind = rng.randrange(4)
                if kind == 0 and num:
                    offsets[0] = rng.choice([1, -1])
                elif kind == 1 and num:
                    offsets[rng.randrange(1, num + 1)] = -1  # decreasing (within the array)
                elif kind == 2:
                    n = -1
            stops_ptr = 0 if hostile and rng.random() < 0.2 else _ptr(flat)
            rc = lib.rhd_set_stops_many(h, n, _ptr(slots), _ptr(offsets), stops_ptr)
        elif op == 7:  # release / queries
            rc = lib.rhd_release_prompt(h, rng.choice([1, 2, 3, -1]))
            lib.rhd_memory_tokens(h, rng.choice([1, 2, 99]))
            lib.rhd_memory_bytes(h, rng.choice([1, 2, 99]))
            lib.rhd_global_tokens(h)
        elif op == 9:  # the batched step, its params written as the wrapper would (or not)
            n = rng.choice([-1, SLOTS + 1, 2**40, 0]) if hostile else rng.randint(0, len(running))
            write_params(n, hostile)
            rc = lib.rhd_step(h)
            if rc == RC_OK:
                offsets = step_offsets[:n + 1].tolist()
                assert offsets[0] == 0 and all(0 <= b - a <= K for a, b in zip(offsets, offsets[1:]))
        elif op == 10:  # cost curves, some hostile; and the threshold they give
            num = rng.choice([0, 1, 2, 5, -1, 5000]) if hostile else rng.choice([0, 2, 5])
            xs = np.arange(1, max(num, 2) + 1, dtype=np.float64) * rng.choice([1, 3, 64])
            ys = np.asarray([rng.uniform(0.1, 5.0) for _ in xs], dtype=np.float64)
            if hostile and num > 1:
                ys[rng.randrange(num)] = rng.choice([float("nan"), 0.0, -1.0, float("inf")])
            rc = lib.rhd_set_curve(h, _ptr(xs), _ptr(ys), num)
            if num == 5000:
                assert rc == RC_INVAL
            out = ctypes.c_double()
            lib.rhd_gain_threshold(h, rng.choice([1, 64, -1, 2**40]), rng.choice([0.5, float("nan"), -1.0]),
                                   rng.choice([1.0, float("inf")]), ctypes.addressof(out))
        elif op == 11:  # the tree step: absurd node caps and widths, or legal ones
            n = rng.choice([-1, SLOTS + 1, 2**40, 0]) if hostile else rng.randint(0, len(running))
            write_params(n, hostile)
            max_nodes = rng.choice([-5, 0, 1, 4, TREE_NODES, TREE_NODES + 1, 2**62, -2**63]) if hostile \
                else rng.choice([1, 4, 16, TREE_NODES])
            width = rng.choice([1, 3, 0, -1, 4, 2**40]) if hostile else rng.choice([1, 2, 3])
            rc = lib.rhd_step_trees(h, max_nodes, width)
            if rc == RC_OK:
                offsets = tree_offsets[:n + 1].tolist()
                assert offsets[0] == 0 and all(0 <= b - a <= TREE_NODES for a, b in zip(offsets, offsets[1:]))
                for a, b in zip(offsets, offsets[1:]):  # each tree's parents come before their children
                    assert all(-1 <= tree_parents[a + j] < j for j in range(b - a))
        else:  # null arrays with counts
            rc = rng.choice([
                lambda: lib.rhd_commit(h, 3, None, None, None, None, None, 5),
                lambda: lib.rhd_propose(h, 2, None, None, 3, 0.1, None, None, None),
                lambda: lib.rhd_load_history(h, 1, None, None, 2, None, None),
                lambda: lib.rhd_add_global(h, None, None, 1),
                lambda: lib.rhd_start(h, 0, 1, None, 4, None, 0),
                lambda: lib.rhd_set_curve(h, None, None, 3),
                lambda: lib.rhd_gain_threshold(h, 4, 1.0, 1.0, None),
                lambda: lib.rhd_bind_trees(h, 2, 4, None, None, None, None),
                lambda: lib.rhd_set_stops_many(h, 2, None, None, None),
            ])()
            assert rc == RC_INVAL
        assert rc in (0, 1, RC_INVAL), (op, rc, lib.rhd_last_error(h))
        codes[rc] = codes.get(rc, 0) + 1
        assert lib.rhd_global_tokens(h) <= 256  # the bound holds whatever came in
        for p in (1, 2):
            assert lib.rhd_memory_tokens(h, p) <= 256
    # still a working drafter: a legal lifecycle goes through
    for s in sorted(running):
        assert lib.rhd_stop(h, s) >= 0
    p = _i32([1, 2, 3, 1, 2, 3])
    assert lib.rhd_start(h, 0, 1, _ptr(p), p.size, 0, 0) == RC_OK
    assert lib.rhd_stop(h, 0) >= 0
    lib.rhd_destroy(h)
    return codes


if __name__ == "__main__":
    lo, hi = int(sys.argv[1]), int(sys.argv[2])
    for s in range(lo, hi):
        fuzz(s)
    print(f"fuzz ok for seeds {lo}..{hi - 1}")
