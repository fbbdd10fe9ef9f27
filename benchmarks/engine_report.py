"""engine_bench's report: the issue's headline figures (null where a run cannot measure
them) and engine.md."""

from __future__ import annotations

import platform

import torch


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} torch threads"


GPU_ONLY = {
    "decode_ms": "decode step time at batch 1/16/64/256 for the Qwen2.5-0.5B/1.5B shapes in bf16: needs a CUDA GPU",
    "floor_ms": "the CUDA-graphed chain of the same weight matrices: needs a CUDA GPU",
    "verify_over_decode_16x8": "verify 16 x 8 over decode 16, Qwen2.5 shapes in bf16: needs a CUDA GPU",
    "syncs_per_step": "host waits for the GPU in one step (torch.cuda.set_sync_debug_mode): needs a CUDA GPU",
    "host_share_b256": "1 - graph forward / engine step at batch 256, Qwen2.5 shapes in bf16: needs a CUDA GPU",
}


def summarize(device: str, rows: list[dict], grpo: dict, invariance: list[dict]) -> dict:
    """The issue's results format: the headline figures, null where this run cannot measure them."""
    out = dict(decode_ms=None, floor_ms=None, verify_over_decode_16x8=None, syncs_per_step=None, host_share_b256=None)
    gpu = [r for r in rows if r["part"] == "gpu"]
    if gpu:
        key = lambda r: f"{r['model'].lower()}_b{r['batch']}"
        out["decode_ms"] = {key(r): r["step_ms"] for r in gpu if r["draft"] == 0}
        out["decode_forward_ms"] = {key(r): r["forward_ms"] for r in gpu if r["draft"] == 0}
        out["floor_ms"] = {key(r): r["measured_floor_ms"] for r in gpu if r["draft"] == 0}
        step = {(r["model"], r["batch"], r["draft"]): r["step_ms"] for r in gpu}
        by_model = {m.lower(): step[(m, 16, 8)] / step[(m, 16, 0)] for m in ("0.5B", "1.5B")
                    if (m, 16, 8) in step and (m, 16, 0) in step}
        out["verify_over_decode_16x8"] = by_model.get("0.5b")
        out["verify_over_decode_16x8_by_model"] = by_model
        syncs = [r["syncs"] for r in gpu if r.get("syncs") is not None]
        out["syncs_per_step"] = max(syncs) if syncs else None
        out["host_share_b256"] = {r["model"].lower(): 1 - r["forward_ms"] / r["step_ms"] for r in gpu
                                  if r["batch"] == 256 and r["draft"] == 0 and r.get("forward_ms")} or None
    out.update({k: grpo.get(k) for k in ("speedup_vs_hf_b1", "speedup_vs_hf_grpo", "spec_speedup_grpo",
                                          "identical_share")})
    out["batch_invariant"] = all(c["invariant"] for c in invariance) if invariance else None
    out["batch_invariance"] = invariance
    out.update({k: v for k, v in grpo.items() if k not in out})
    out["not_measured"] = [f"{k}: {why} (this run: {device})" for k, why in GPU_ONLY.items() if out[k] is None]
    return out


# The results format; a GPU run fills every one (per shape where it is a dict).
HEADLINE = ("decode_ms", "floor_ms", "verify_over_decode_16x8", "syncs_per_step", "host_share_b256", "speedup_vs_hf_b1", "speedup_vs_hf_grpo",
            "spec_speedup_grpo", "identical_share", "batch_invariant")


def markdown(meta: dict, summary: dict, rows: list[dict]) -> str:
    lines = ["# Engine benchmark\n", f"- device: {meta['device']}", f"- commit: {meta['commit']}",
             f"- command: `{meta['command']}`", f"- torch {meta['torch']}\n", "## Headline figures\n",
             "| figure | value |", "|---|---|"]
    for k in HEADLINE:
        v = summary.get(k)
        if isinstance(v, dict):
            v = ", ".join(f"{a}: {b:.3f}" if isinstance(b, float) else f"{a}: {b}" for a, b in v.items())
        elif isinstance(v, float):
            v = f"{v:.3f}"
        lines.append(f"| {k} | {'not measured' if v is None else v} |")
    if summary.get("not_measured"):
        lines += ["\nNot measured in this run:\n"] + [f"- {x}" for x in summary["not_measured"]]
    if summary.get("grpo_setting"):
        lines.append(f"\nGRPO batch: {summary['grpo_setting']}; first divergences of non-identical samples at "
                     f"generated positions {summary.get('first_divergence_positions') or 'none'}.")
    for c in summary.get("batch_invariance", []):
        diffs = ", ".join(f"{k}: {v:.2e}" for k, v in c["max_abs_diff"].items())
        lines.append(f"\nBatch invariance, {c['model']}: {c['invariant']} (max |logit diff| vs the probe "
                     f"decoded alone: {diffs})")
    sections = [("b1", "Trained tiny policy, batch 1 (greedy, fixed length)"),
                ("grpo", "Trained tiny policy, one GRPO batch on the recorded prompts"),
                ("cpu", "Tiny random model (4 layers, hidden 256), same prompts and seeds")]
    for part, title in sections:
        sel = [r for r in rows if r["part"] == part]
        if not sel:
            continue
        lines += [f"\n## {title}\n",
                  "| system | sampling | tokens | s | tokens/s | forward steps | draft tok | accepted | "
                  "accepted/verify | identical |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in sel:
            lines.append(f"| {r['system']} | {r['sampling']} | {r['tokens']} | {r['seconds']:.2f} | "
                         f"{r['tokens'] / r['seconds']:.0f} | {r['steps']} | {r.get('draft_tokens', '')} | "
                         f"{r.get('accepted_tokens', '')} | {r.get('mean_accepted_per_verify', 0):.2f} | "
                         f"{r.get('identical_to', '')} |")
    gpu = [r for r in rows if r["part"] == "gpu"]
    if gpu:
        lines += ["\n## GPU: decode/verify step, random bf16 weights\n",
                  "| model | batch | draft | tokens/forward | graph forward ms | engine step ms | measured floor ms | "
                  "H100 table ms | HBM floor ms |", "|---|---|---|---|---|---|---|---|---|"]
        for r in gpu:
            fwd = f"{r['forward_ms']:.3f}" if r["forward_ms"] is not None else "n/a"
            floor = f"{r['measured_floor_ms']:.3f}" if r["measured_floor_ms"] is not None else ""
            lines.append(f"| {r['model']} | {r['batch']} | {r['draft']} | {r['tokens_per_forward']} | {fwd} | "
                         f"{r['step_ms']:.3f} | {floor} | {r['design_ms']:.2f} | {r['floor_ms']:.2f} |")
    else:
        lines.append("\nGPU part: unmeasured here (run `make bench-gpu`, i.e. "
                     "`python -m benchmarks.engine_bench --device cuda`).")
    return "\n".join(lines) + "\n"
