"""How fast are the Triton kernels against their references and torch's own attention?

    python -m benchmarks.kernels_bench            # needs a CUDA GPU; exits 1 without one

Times (triton.testing.do_bench, median) on the GPU:
- paged_attention for decode (batch 1/16/64/256, contexts 512-2048) and speculative
  verify (1 + K query tokens per sequence): Triton eager (with Python launch cost),
  Triton in a CUDA graph (the engine's case), the PyTorch reference, and, as dense
  baselines that read contiguous (unpaged) KV, FlexAttention and SDPA;
- sample() on a Qwen-sized vocabulary: Triton (split across vocabulary blocks at up to
  SPLIT_MAX_ROWS rows) vs Triton with one program per row vs reference, with and without
  top-p (eager only), and whether the two Triton paths agree bit for bit.
Writes benchmarks/results/kernels.md and kernels.json with the device, commit and command.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.provenance import git_commit

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 151_936  # Qwen2/2.5
# (name, num_heads, num_kv_heads, head_dim): the attention shapes the engine serves.
MODELS = [("qwen2.5-0.5b", 14, 2, 64), ("qwen2.5-7b", 28, 4, 128)]
BLOCK_SIZE = 16


def bench(fn, graph: bool = False) -> float | None:
    """Median milliseconds of fn, or None when it cannot run (reported as n/a)."""
    import triton.testing

    try:
        fn()  # warm-up / compile
        torch.cuda.synchronize()
        if graph:
            return triton.testing.do_bench_cudagraph(fn, return_mode="median")
        return triton.testing.do_bench(fn, return_mode="median")
    except Exception as e:  # noqa: BLE001 - a baseline that fails is reported, not fatal
        print(f"    ({getattr(fn, '__name__', 'fn')} failed: {type(e).__name__}: {str(e)[:120]})")
        return None


def paged_batch(num_seqs, context_len, query_len, num_heads, num_kv_heads, head_dim):
    """A uniform batch on a shuffled block pool (paged) plus the same KV dense."""
    blocks_per_seq = -(-context_len // BLOCK_SIZE)
    num_blocks = num_seqs * blocks_per_seq
    dev, dtype = "cuda", torch.bfloat16
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=dev, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context_len, dtype=torch.int32, device=dev)
    cu_q = torch.arange(num_seqs + 1, dtype=torch.int32, device=dev) * query_len
    q = torch.randn(num_seqs * query_len, num_heads, head_dim, device=dev, dtype=dtype)
    # Dense [num_seqs, num_kv_heads, context_len, head_dim] copies for the unpaged baselines.
    def dense(cache):
        return cache[block_tables.long()].flatten(1, 2)[:, :context_len].transpose(1, 2).contiguous()
    q_dense = q.view(num_seqs, query_len, num_heads, head_dim).transpose(1, 2).contiguous()
    paged = (q, k_cache, v_cache, block_tables, seq_lens, cu_q)
    return paged, (q_dense, dense(k_cache), dense(v_cache))


def attention_rows(quick: bool):
    from torch.nn.attention.flex_attention import create_block_mask

    from kernels import paged_attention as pa

    flex = _compiled_flex_attention()
    cases = [("decode", b, c, 1) for b in (1, 16, 64, 256) for c in (512, 1024, 2048)]
    cases += [("verify", b, c, 1 + k) for b, k in ((16, 7), (16, 15), (64, 7), (256, 3)) for c in (1024, 2048)]
    if quick:
        cases = [c for c in cases if c[2] == 1024]
    rows = []
    for model, num_heads, num_kv_heads, head_dim in MODELS:
        for kind, num_seqs, context_len, query_len in cases:
            paged, (q_d, k_d, v_d) = paged_batch(num_seqs, context_len, query_len, num_heads, num_kv_heads,
                                                 head_dim)
            scale = head_dim ** -0.5
            offset = context_len - query_len

            def triton_fn():
                return pa.paged_attention_triton(*paged, scale, query_len)

            def reference_fn():
                return pa.paged_attention_reference(*paged, scale, query_len)

            # Dense baselines: their masks and GQA expansion are built outside the timed call.
            def causal(b, h, q_idx, kv_idx):
                return kv_idx <= q_idx + offset

            block_mask = create_block_mask(causal, None, None, query_len, context_len, device="cuda")
            sdpa_mask = None if query_len == 1 else torch.ones(
                query_len, context_len, dtype=torch.bool, device="cuda").tril(offset)  # [qlen, ctx]
            group = num_heads // num_kv_heads
            k_rep, v_rep = k_d.repeat_interleave(group, 1), v_d.repeat_interleave(group, 1)

            def sdpa_fn():
                return torch.nn.functional.scaled_dot_product_attention(
                    q_d, k_rep, v_rep, attn_mask=sdpa_mask, scale=scale)

            def flex_fn():
                return flex(q_d, k_d, v_d, block_mask=block_mask, scale=scale, enable_gqa=True)

            error = (triton_fn().float() - reference_fn().float()).abs().max().item()
            t_triton = bench(triton_fn)
            t_graph = bench(triton_fn, graph=True)
            kv_bytes = 2 * num_seqs * context_len * num_kv_heads * head_dim * 2
            rows.append({
                "model": model, "kind": kind, "num_seqs": num_seqs, "context_len": context_len,
                "query_len": query_len, "triton_ms": t_triton, "triton_graph_ms": t_graph,
                "reference_ms": bench(reference_fn), "flex_dense_ms": bench(flex_fn) if flex else None,
                "sdpa_dense_ms": bench(sdpa_fn),
                "triton_graph_kv_gbps": kv_bytes / t_graph / 1e6 if t_graph else None,
                "max_abs_err_vs_reference": error,
            })
            print(_fmt_row(rows[-1]), flush=True)
    return rows


def sampling_rows(quick: bool):
    from kernels import sampling as sp

    rows = []
    for n in (1, 64) if quick else (1, 64, 256):
        for top_p in (0.0, 0.95):
            logits = (torch.randn(n, VOCAB, device="cuda") * 3).bfloat16()
            args = (torch.full((n,), 0.8, device="cuda"), torch.zeros(n, dtype=torch.int32, device="cuda"),
                    torch.full((n,), top_p, device="cuda"), torch.zeros(n, device="cuda"),
                    torch.arange(n, device="cuda", dtype=torch.int64),
                    torch.full((n,), 100, dtype=torch.int64, device="cuda"))
            tokens, logprobs = sp.sample_triton(logits, *args)
            unsplit = sp.sample_triton(logits, *args, split=False)
            ref_tokens, _ = sp.sample_reference(logits, *args)
            rows.append({
                "num_rows": n, "vocab": VOCAB, "top_p": top_p,
                "triton_ms": bench(lambda: sp.sample_triton(logits, *args)),
                "triton_one_program_per_row_ms": bench(lambda: sp.sample_triton(logits, *args, split=False)),
                "reference_ms": bench(lambda: sp.sample_reference(logits, *args)),
                "tokens_equal": bool(torch.equal(tokens, ref_tokens)),
                "split_bitwise": bool(torch.equal(tokens, unsplit[0]) and torch.equal(logprobs, unsplit[1])),
            })
            print(_fmt_row(rows[-1]), flush=True)
    return rows


def _compiled_flex_attention():
    try:
        from torch.nn.attention.flex_attention import flex_attention
        return torch.compile(flex_attention)
    except Exception as e:  # noqa: BLE001 - an older torch without FlexAttention
        print(f"FlexAttention unavailable: {e}")
        return None


def _fmt(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.4f}" if x < 10 else f"{x:.1f}"
    return str(x)


def _fmt_row(row: dict) -> str:
    return " | ".join(f"{k}={_fmt(v)}" for k, v in row.items())


def _markdown(title: str, rows: list[dict]) -> str:
    if not rows:
        return ""
    keys = list(rows[0])
    lines = [f"## {title}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="contexts of 1024 only, fewer sampling rows")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("kernels_bench needs a CUDA GPU: none here (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 1
    import triton

    meta = {
        "device": torch.cuda.get_device_name(), "commit": git_commit(),
        "command": " ".join(["python -m benchmarks.kernels_bench", *sys.argv[1:]]),
        "torch": torch.__version__, "triton": triton.__version__, "dtype": "bfloat16",
        "block_size": BLOCK_SIZE, "timer": "triton.testing.do_bench median (graph: do_bench_cudagraph)",
        "note": "flex/sdpa baselines read dense contiguous KV (no paging); triton_ms includes Python launch cost",
    }
    print(json.dumps(meta, indent=1))
    attention, sampling = attention_rows(args.quick), sampling_rows(args.quick)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels.json").write_text(json.dumps(
        {"meta": meta, "paged_attention": attention, "sampling": sampling}, indent=1))
    header = "# Kernel benchmark\n\n" + "\n".join(f"- {k}: {v}" for k, v in meta.items()) + "\n\n"
    (out / "kernels.md").write_text(header + _markdown("paged_attention (ms)", attention) + "\n"
                                    + _markdown("sample (ms)", sampling))
    print(f"wrote {out / 'kernels.md'} and {out / 'kernels.json'}")
    if not any(r["triton_graph_ms"] for r in attention) or not any(r["triton_ms"] for r in sampling):
        print("kernels_bench: the Triton kernels measured nothing (every timing failed; see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
