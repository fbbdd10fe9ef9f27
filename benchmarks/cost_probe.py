"""The forward-cost table of docs/cost-model.md, measured by a script of this repository.

    python -m benchmarks.cost_probe                         # on a CUDA GPU (the GPU campaign)
    python -m benchmarks.cost_probe --dry-run --out DIR     # the CPU rehearsal: tiny shapes

For the Qwen2.5-0.5B, 1.5B and 7B shapes: one forward over the weight matrices only (every
layer's q, k, v, o, gate, up and down projections, then the LM head; no attention, norms
or activations), M tokens x the matrices in bf16 with cuBLAS, captured as one CUDA graph;
the replay time in ms at M = 1, 32, 128, 256, 512, beside the table in
services/common/cost_curve.py (H100_CURVES), which came from a probe of this kind that
was never in the repository. Writes benchmarks/results/<device>/cost_probe.{md,json} after
each shape.
"""

from __future__ import annotations

import argparse
import re
import signal
import sys
import time
from pathlib import Path

import torch

from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import write_results
from services.common.cost_curve import H100_CURVES

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS = (1, 32, 128, 256, 512)
# name -> (hidden, intermediate, layers, heads, kv heads, head_dim, vocabulary): the published configs
SHAPES = {
    "0.5B": (896, 4864, 24, 14, 2, 64, 151936),
    "1.5B": (1536, 8960, 28, 12, 2, 128, 151936),
    "7B": (3584, 18944, 28, 28, 4, 128, 152064),
}
DRY_SHAPES = {"tiny": (64, 128, 2, 4, 2, 16, 100)}


def weight_matrices(dims: tuple[int, ...], device: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """[out, in] matrices of one forward, N(0, 1/in), in order."""
    hidden, inter, layers, heads, kv, head_dim, vocab = dims
    shapes = [(heads * head_dim, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden), (hidden, heads * head_dim),
              (inter, hidden), (inter, hidden), (hidden, inter)] * layers + [(vocab, hidden)]
    return [torch.empty(s, device=device, dtype=dtype).normal_(0, s[1] ** -0.5) for s in shapes]


@torch.inference_mode()
def chain_ms(weights: list[torch.Tensor], batch: int, repeats: int = 20) -> float:
    """Every matrix multiplied by a [batch, in_features] input, one after another, captured
    as one CUDA graph; the replay's mean ms. Off a GPU: one eager pass (checks shapes only)."""
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], device=w.device, dtype=w.dtype) for w in weights}
    outputs = [torch.empty(batch, w.shape[0], device=w.device, dtype=w.dtype) for w in weights]

    def chain() -> None:
        for w, y in zip(weights, outputs):
            torch.matmul(inputs[w.shape[1]], w.t(), out=y)

    if weights[0].device.type != "cuda":
        start = time.perf_counter()
        chain()
        return (time.perf_counter() - start) * 1e3
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chain()  # warm-up (cuBLAS handles, workspaces) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def markdown(result: dict) -> str:
    lines = ["# Forward cost over the weight matrices (cost_probe)\n", f"- device: {result['device']}",
             f"- commit: {result['commit']}", f"- command: `{result['command']}`", f"- setting: {result['setting']}"]
    if result["dry_run"]:
        lines.append("\n**A dry run (tiny shape, CPU): checks the probe runs; not a measurement.**")
    lines += ["", "| model | weights GiB | " + " | ".join(f"M={m}" for m in TOKENS) + " |",
              "|---|---|" + "---|" * len(TOKENS)]
    for name, s in result["shapes"].items():
        cells = []
        for m in TOKENS:
            ms, table = s["ms"].get(str(m)), s["table_ms"].get(str(m))
            cells.append("–" if ms is None else f"{ms:.3f}" + (f" (table {table})" if table is not None else ""))
        lines.append(f"| {name} | {s['weights_gib']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny shape; written to --out only")
    p.add_argument("--out", help="results folder (default benchmarks/results/<device>/)")
    args = p.parse_args(argv)
    if args.dry_run and not args.out:
        print("cost_probe --dry-run: give --out (never written into benchmarks/results)", file=sys.stderr)
        return 2
    if not args.dry_run and not torch.cuda.is_available():
        print("cost_probe: no CUDA device (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    name = torch.cuda.get_device_name() if device == "cuda" else f"{cpu_name()} CPU"
    out = Path(args.out) if args.out else RESULTS / re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        torch.set_num_threads(1)  # a dry run on a shared machine
    result = dict(device=name, commit=git_commit(), torch=torch.__version__, dry_run=args.dry_run,
                  command=" ".join(["python -m benchmarks.cost_probe", *argv]),
                  setting=f"weight matrices only, {str(dtype).removeprefix('torch.')}, "
                          f"{'one CUDA graph per M, mean of 20 replays' if device == 'cuda' else 'one eager pass'}",
                  shapes={})
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    for shape, dims in (DRY_SHAPES if args.dry_run else SHAPES).items():
        weights = weight_matrices(dims, device, dtype)
        entry = dict(dims=dict(zip(("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"),
                                   dims)),
                     weights_gib=sum(w.numel() * w.element_size() for w in weights) / 2**30,
                     table_ms={str(m): ms for m, ms in H100_CURVES.get(shape, ())}, ms={})
        for m in TOKENS if not args.dry_run else (1, 32):
            entry["ms"][str(m)] = chain_ms(weights, m)
        result["shapes"][shape] = entry
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()
        write_results(out, "cost_probe", result, markdown(result))
        print(f"{shape}: {entry['ms']}", flush=True)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
