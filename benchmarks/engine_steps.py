"""The engine's step costs at real model shapes, alone (the GPU campaign's first measurement).

    python -m benchmarks.engine_steps --device cuda       # Qwen2.5-0.5B and 1.5B shapes, bf16
    python -m benchmarks.engine_steps --dry-run --out DIR # the CPU rehearsal: a tiny shape

engine_bench's GPU part (benchmarks/engine_gpu_steps.py: random weights, decode at batch
1/16/64/256 and verify steps up to 256 tokens) without the trained-policy comparisons, so
it fits a slice of one GPU window. Per row: the whole engine step, its CUDA-graph forward,
the measured floor (a CUDA-graphed chain of the same weight matrices), and what follows:
decode over floor, verify over decode at the same batch, and the host's share of the step
(1 - forward / step: laying out the batch, sampling, bookkeeping). Writes
benchmarks/results/<device>/engine_steps.{md,json} after every row, so a run cut short
keeps what it measured. Each case also counts the host's waits for the GPU in one more
step (`torch.cuda.set_sync_debug_mode`: `syncs`; the top-level `syncs_per_step` is the most
of any case; null on the CPU dry run, which has no device to wait for).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

import torch

from benchmarks.engine_gpu_steps import CASES, gpu_part, qwen_shape
from benchmarks.engine_random_model import TINY
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table, write_results

RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = [("model", "model", "{}"), ("batch", "batch", "{}"), ("draft", "draft", "{}"), ("step ms", "step_ms", "{}"),
           ("forward ms", "forward_ms", "{}"), ("floor ms", "measured_floor_ms", "{}"),
           ("step / floor", "step_over_floor", "{}"), ("verify / decode", "verify_over_decode", "{}"),
           ("host share", "host_share", "{}"), ("syncs", "syncs", "{}")]
SYNCS_REASON = "a CPU dry run: no device to wait for"


def derive(rows: list[dict]) -> list[dict]:
    """Each row with step_over_floor, verify_over_decode (same model and batch) and host_share."""
    decode = {(r["model"], r["batch"]): r["step_ms"] for r in rows if r["draft"] == 0}
    out = []
    for r in rows:
        d = decode.get((r["model"], r["batch"]))
        out.append(dict(r, step_over_floor=r["step_ms"] / r["measured_floor_ms"] if r.get("measured_floor_ms") else None,
                        verify_over_decode=r["step_ms"] / d if r["draft"] and d else None,
                        host_share=1 - r["forward_ms"] / r["step_ms"] if r.get("forward_ms") else None))
    return out


def markdown(result: dict) -> str:
    def cell(v):
        return "–" if v is None else f"{v:.3f}" if isinstance(v, float) else v

    rows = [{k: cell(v) for k, v in r.items()} for r in result["rows"]]
    lines = ["# Engine step costs at the Qwen2.5 shapes (engine_steps)\n", f"- device: {result['device']}",
             f"- commit: {result['commit']}", f"- command: `{result['command']}`",
             f"- setting: {result['setting']}"]
    if result["dry_run"]:
        lines.append("\n**A dry run (tiny shape, CPU): checks the part runs; not a measurement.**")
    syncs = (f"at most {result['syncs_per_step']} (torch.cuda.set_sync_debug_mode over one step of each case)"
             if result["syncs_per_step"] is not None else f"not measured ({result['syncs_per_step_reason']})")
    lines += ["", markdown_table(rows, COLUMNS), "", f"- syncs per step: {syncs}",
              "- floor: every weight matrix of the shape (q, k, v, o, gate, up, down, the LM head) in one CUDA graph"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--context-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=30, help="timed steps per case")
    p.add_argument("--dry-run", action="store_true", help="CPU, a tiny shape, two cases; written to --out only")
    p.add_argument("--out", help="results folder (default benchmarks/results/<device>/)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.device, args.context_len, args.steps = "cpu", 8, 2
        if not args.out:
            print("engine_steps --dry-run: give --out (never written into benchmarks/results)", file=sys.stderr)
            return 2
    elif not torch.cuda.is_available():
        print("engine_steps: no CUDA device (torch.cuda.is_available() is False); nothing measured", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else "cuda"
    name = torch.cuda.get_device_name() if device == "cuda" else f"{cpu_name()} CPU"
    out = Path(args.out) if args.out else RESULTS / __import__("re").sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    out.mkdir(parents=True, exist_ok=True)
    if device == "cpu":
        torch.set_num_threads(1)
    result = dict(device=name, commit=git_commit(), torch=torch.__version__, dry_run=args.dry_run,
                  command=" ".join(["python -m benchmarks.engine_steps", *argv]),
                  setting=f"random bf16 weights, {args.context_len} tokens of context per sequence, "
                          f"{args.steps} timed steps per case after 3 untimed",
                  syncs_per_step=None, syncs_per_step_reason=SYNCS_REASON, rows=[])
    raw: list[dict] = []

    def on_row(row: dict) -> None:
        raw.append(row)
        result["rows"] = derive(raw)
        counted = [r["syncs"] for r in raw if r.get("syncs") is not None]
        if counted:
            result.update(syncs_per_step=max(counted), syncs_per_step_reason=None)
        write_results(out, "engine_steps", result, markdown(result))

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # a time limit: keep what is written
    if args.dry_run:
        gpu_part(args.context_len, args.steps, shapes={"tiny": TINY}, cases=[(2, 0), (2, 3)], device="cpu",
                 on_row=on_row)
    else:
        # the 1.5B shape first: the one the campaign's sweep and e2e run at
        gpu_part(args.context_len, args.steps, shapes={n: qwen_shape(n) for n in ("1.5B", "0.5B")}, cases=CASES,
                 on_row=on_row)
    print((out / "engine_steps.md").read_text())
    return 0 if raw else 1


if __name__ == "__main__":
    sys.exit(main())
