"""The CPU paged attention with the compiled passes against the PyTorch reference, side by side.

    python -m benchmarks.cpu_attention [--repeats 5] [--threads 2]

A CPU worker's decode and verify steps attend over the paged KV cache once per layer.
The reference (``paged_attention_reference``) gathers every sequence's context into
dense padded K and V, then runs matmuls; the compiled passes
(``kernels/paged_attention_native.py``) read the cache in place. For each case (one
layer's call: sequences x context x query rows, at a real model's head layout) it
reports the median process CPU time and wall time of each, their ratio, and the largest
difference between their outputs (float32 rounding: it must stay below 1e-4). A decode
step runs this once per layer (SmolLM2-135M: 30 layers, 9 query heads over 3 KV heads of
64; Qwen2.5-0.5B: 24 layers, 14 over 2).

Writes benchmarks/results/cpu_attention.md and .json (device, commit, command). A CPU
ratio: it says how much of a CPU worker's step attention was, not how a GPU attends.
"""

from __future__ import annotations

import json
import platform
import sys

import torch

from benchmarks.cpu_sampler import compiled_cli, side_by_side
from benchmarks.provenance import cpu_name, git_commit
from kernels import paged_attention_native as native
from kernels.paged_attention import paged_attention_reference

BLOCK_SIZE = 16
SHAPES = {"smollm2": (9, 3, 64), "qwen2.5-0.5b": (14, 2, 64)}  # query heads, KV heads, head size
# (shape, sequences, context tokens, query rows per sequence): decodes of a GRPO batch as
# its responses grow, and verify steps of 1 + 4 draft tokens
CASES = [("smollm2", 1, 600, 1), ("smollm2", 16, 600, 1), ("smollm2", 64, 300, 1), ("smollm2", 256, 300, 1),
         ("smollm2", 256, 600, 1), ("smollm2", 64, 600, 5), ("qwen2.5-0.5b", 256, 600, 1),
         ("qwen2.5-0.5b", 64, 1200, 5)]


def inputs(shape: str, num_seqs: int, ctx: int, qlen: int):
    """A shuffled block pool holding each sequence's context (lengths spread over the
    upper half of ``ctx``, the longest exactly ``ctx``), its newest ``qlen`` rows queried."""
    heads, kv_heads, head_dim = SHAPES[shape]
    gen = torch.Generator().manual_seed(num_seqs * 1000 + ctx + qlen)
    lens = torch.randint(ctx // 2, ctx + 1, (num_seqs,), generator=gen)
    lens[0] = ctx
    blocks = -(-ctx // BLOCK_SIZE)
    num_blocks = num_seqs * blocks + 8
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:num_seqs * blocks].view(num_seqs, blocks).int()
    starts = torch.arange(num_seqs + 1, dtype=torch.int32) * qlen
    q = torch.randn(num_seqs * qlen, heads, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, lens.int(), starts, head_dim ** -0.5, qlen


def case(shape: str, num_seqs: int, ctx: int, qlen: int, repeats: int) -> dict:
    args = inputs(shape, num_seqs, ctx, qlen)
    times, ref, out = side_by_side(lambda: paged_attention_reference(*args),
                                   lambda: native.paged_attention_native(*args), repeats)
    return dict(shape=shape, seqs=num_seqs, context=ctx, query_rows=qlen, **times,
                max_abs_diff=float((out - ref).abs().max()))


def main(argv: list[str] | None = None) -> int:
    args = compiled_cli(__doc__, argv, native, "the compiled passes")
    if args is None:
        return 1
    rows = []
    print(f"{'shape':>12} {'seqs':>5} {'ctx':>5} {'q':>2} | {'ref CPU ms':>10} {'compiled':>9} {'ratio':>6} | "
          f"{'ref wall ms':>11} {'compiled':>9} {'ratio':>6} | max diff")
    for shape, n, ctx, qlen in CASES:
        r = case(shape, n, ctx, qlen, args.repeats)
        rows.append(r)
        print(f"{shape:>12} {n:>5} {ctx:>5} {qlen:>2} | {r['reference_cpu_ms']:>10} {r['compiled_cpu_ms']:>9} "
              f"{r['cpu_ratio']:>5}x | {r['reference_wall_ms']:>11} {r['compiled_wall_ms']:>9} {r['wall_ratio']:>5}x | "
              f"{r['max_abs_diff']:.1e}", flush=True)
    meta = dict(device=f"cpu: {cpu_name()}", commit=git_commit(), python=platform.python_version(),
                torch=torch.__version__, threads=args.threads, repeats=args.repeats,
                command="python -m benchmarks.cpu_attention " + " ".join(argv if argv is not None else sys.argv[1:]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_attention.json").write_text(json.dumps(dict(meta, rows=rows), indent=1) + "\n")
    lines = ["# CPU paged attention: compiled passes vs the PyTorch reference", "",
             f"`{meta['command']}` at commit {meta['commit']} on {meta['device']} ({args.threads} torch threads, "
             f"median of {args.repeats}). One layer's attention call over a paged KV cache (block size {BLOCK_SIZE}); "
             "a decode step makes one per layer. CPU time is the process's, so it counts every thread. "
             "Ratios are this CPU's.", "",
             "| shape | sequences | context | query rows | reference CPU ms | compiled CPU ms | CPU ratio "
             "| reference wall ms | compiled wall ms | wall ratio | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['seqs']} | {r['context']} | {r['query_rows']} | {r['reference_cpu_ms']} | "
              f"{r['compiled_cpu_ms']} | {r['cpu_ratio']}x | {r['reference_wall_ms']} | {r['compiled_wall_ms']} | "
              f"{r['wall_ratio']}x | {r['max_abs_diff']:.1e} |" for r in rows]
    (args.out / "cpu_attention.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'cpu_attention.md'} and .json")
    return 0 if all(r["max_abs_diff"] < 1e-4 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
