"""How much faster is a whole GRPO rollout step with rhymerl than with a plain engine?

    python -m benchmarks.e2e_bench                                 # CPU: 2 workers, the tiny policy
    python -m benchmarks.e2e_bench --device cuda --workers 4       # GPU (make e2e-gpu): workers share it
    python -m benchmarks.e2e_bench --device cuda --workers 1 --widen Qwen2.5-1.5B   # at a real shape
    python -m benchmarks.e2e_bench --model smollm2 --workers 1 --epochs 3 --prompts 8 --n 4 --max-tokens 128

With --model smollm2 the workers serve SmolLM2-135M-Instruct (models/smollm2-135m, written
by `make model-smollm2`, which `make e2e-smollm2` runs first; docs/smollm2.md) and the trainer runs GRPO on the English
word-problem task (chat template, real tokenizer, its last 2 layers trained); the results
go to e2e_smollm2.{md,json} beside the tiny policy's e2e.{md,json}.

With --widen, the workers serve the policy widened to a real shape (services/rollout/models/
widen.py: the same function at that shape's cost); the trainer keeps training the small
checkpoint and every update it pushes is widened again before it reaches the workers.

Two real systems side by side in one run, each as separate processes (services/local.py's
LocalCluster: history with its redis-server, the scheduler, W rollout workers):
- baseline: `static` placement (veRL's split: a group pinned to one worker, no chunks),
  workers without speculation: what a trainer gets from a plain engine;
- rhymerl: `rhymerl` placement (divided rollout, length predictions from history),
  workers drafting from the history service (earlier epochs' responses to the prompt).
The example GRPO trainer runs R epochs over the recorded prompt set (the reasoning task's
prompts of benchmarks/data/tiny_grpo_service.npz) through benchmarks/tiny_llm/paired_client.py:
every epoch goes to both systems with the same step id, prompts, sampling and seed; the
trainer learns from the baseline's samples and pushes the weights to both, so both sample
the same policy every epoch. Per epoch: the rollout call's wall time in each system and
their ratio, tokens/s, accepted tokens per verify step and the bubble ratio (the step
summaries), and the share of samples identical token for token between the two.
Per epoch and system, where the workers' time went (scraped from their /metrics before and
after: workers summed): engine steps by kind (prefill, decode, verify) with their seconds,
forwards that ran eagerly instead of replaying a CUDA graph, prompt tokens prefilled (a
divided rollout's resumed chunks re-prefill their uncached tail), and the share of the wall
time the engines were stepping. The rest of the wall time is the service path (gRPC, the
scheduler, chunk hand-offs) or idle workers.
Writes benchmarks/results/e2e.md and e2e.json (after every epoch: a run cut short keeps
what it measured). Exits non-zero if no epoch completed or a sample was lost.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table, write_results
from benchmarks.tiny_llm.checkpoint import ensure_model
from benchmarks.tiny_llm.examples import load_example
from benchmarks.tiny_llm.paired_client import PairedClient, TimedStep, identical_share
from services.common.traces import read_traces
from services.local import ROOT, LocalCluster

RESULTS = Path(__file__).resolve().parent / "results"
RECORDED = Path(__file__).resolve().parent / "data" / "tiny_grpo_service.npz"
COLUMNS = [("epoch", "epoch", "{}"), ("baseline s", "baseline_s", "{:.2f}"), ("rhymerl s", "rhymerl_s", "{:.2f}"),
           ("ratio", "ratio", "{:.2f}"), ("baseline tok/s", "baseline_tokens_per_s", "{:.0f}"),
           ("rhymerl tok/s", "rhymerl_tokens_per_s", "{:.0f}"), ("accepted/verify", "accepted_per_verify", "{:.2f}"),
           ("bubble (rhymerl)", "bubble_ratio", "{:.3f}"), ("bubble (baseline)", "baseline_bubble_ratio", "{:.3f}"),
           ("identical", "identical_share", "{:.3f}"), ("tokens", "tokens", "{}")]


def epoch_row(epoch: int, base: TimedStep, ours: TimedStep) -> dict:
    s, b = ours.result.summary, base.result.summary
    return dict(
        epoch=epoch, baseline_s=base.wall_s, rhymerl_s=ours.wall_s, ratio=base.wall_s / ours.wall_s,
        identical_share=identical_share(base.result, ours.result),
        accepted_per_verify=s.num_accepted_tokens / s.num_verify_steps if s.num_verify_steps else 0.0,
        bubble_ratio=s.bubble_ratio, baseline_bubble_ratio=b.bubble_ratio,
        baseline_tokens_per_s=base.num_tokens / base.wall_s, rhymerl_tokens_per_s=ours.num_tokens / ours.wall_s,
        tokens=base.num_tokens, rhymerl_tokens=ours.num_tokens, acceptance_rate=s.acceptance_rate,
        history_hit_rate=s.history_hit_rate, baseline_makespan_s=b.makespan_s, rhymerl_makespan_s=s.makespan_s,
        aborted=base.num_aborted + ours.num_aborted, reward=None)  # the trainer's, once it has scored


STEP_KINDS = ("prefill", "decode", "verify")
BREAKDOWN = [("epoch", "epoch", "{}"), ("system", "system", "{}"), ("wall s", "wall_s", "{:.2f}"),
             ("engine share", "engine_share", "{:.2f}"), ("steps p/d/v", "steps", "{}"),
             ("step s p/d/v", "step_s", "{}"), ("ms/step p/d/v", "ms_per_step", "{}"),
             ("eager forwards", "eager_forwards", "{:.0f}"), ("prompt tokens", "prompt_tokens", "{:.0f}")]


def breakdown(epoch: int, system: str, wall_s: float, before: dict, after: dict) -> dict:
    """One system's epoch: the counters' growth over it, beside its wall time."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = [int(d.get(f"{k}_steps", 0)) for k in STEP_KINDS]
    seconds = [d.get(f"{k}_s", 0.0) for k in STEP_KINDS]
    return dict(epoch=epoch, system=system, wall_s=wall_s, engine_share=sum(seconds) / wall_s if wall_s else 0.0,
                steps="/".join(map(str, steps)), step_s="/".join(f"{x:.2f}" for x in seconds),
                ms_per_step="/".join(f"{1e3 * x / n:.1f}" if n else "-" for x, n in zip(seconds, steps)),
                eager_forwards=d.get("eager_forwards", 0.0), graph_forwards=d.get("graph_forwards", 0.0),
                prompt_tokens=d.get("prompt_tokens", 0.0),
                **{f"{k}_steps": n for k, n in zip(STEP_KINDS, steps)},
                **{f"{k}_seconds": x for k, x in zip(STEP_KINDS, seconds)})


class WidenedPushes:
    """The trainer's client, with every weight push widened to the workers' shape: the
    trainer updates the small policy, the workers serve it at the real shape."""

    def __init__(self, client, source, shape, device: str, dtype: str):
        self.client, self.source, self.shape, self.device, self.dtype = client, source, shape, device, dtype

    def __getattr__(self, name):
        return getattr(self.client, name)

    def push_weights(self, version: int, data: bytes) -> int:
        import safetensors.torch
        import torch

        from services.rollout.loader import read_safetensors
        from services.rollout.models.widen import widen_state

        wide = widen_state(read_safetensors(data), self.source, self.shape, seed=0, device=self.device,
                           dtype=getattr(torch, self.dtype))
        return self.client.push_weights(version, safetensors.torch.save({k: v.cpu() for k, v in wide.items()}))


def model_shape(model_dir: str, widen: str | None) -> dict:
    """The workers' model shape as e2e.json records it."""
    from services.rollout.loader import read_config

    c = read_config(model_dir)
    layer = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * c.hidden_size \
        + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    params = c.num_hidden_layers * layer + c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return dict(name=widen or Path(model_dir).name, widened=widen is not None, hidden_size=c.hidden_size,
                intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                head_dim=c.head_dim, vocab_size=c.vocab_size, matrix_params=params)


def cluster_env(args) -> dict[str, str]:
    """Worker settings beyond LocalCluster's CPU defaults (they win over its own)."""
    return {"RHYMERL_WORKER_DEVICE": args.device, "RHYMERL_WORKER_DTYPE": args.dtype,
            "RHYMERL_WORKER_MAX_NUM_SEQS": str(args.max_num_seqs), "RHYMERL_WORKER_NUM_KV_BLOCKS": str(args.kv_blocks)}


def summarize(args, rows: list[dict], meta: dict) -> dict:
    ratios = [r["ratio"] for r in rows]
    later = ratios[1:]  # epoch 0 has no history to draft from or predict with
    return dict(
        **meta, epochs=rows, mean_ratio=statistics.fmean(ratios) if ratios else None,
        mean_ratio_with_history=statistics.fmean(later) if later else None,
        total_ratio=sum(r["baseline_s"] for r in rows) / sum(r["rhymerl_s"] for r in rows) if rows else None,
        mean_identical_share=statistics.fmean(r["identical_share"] for r in rows) if rows else None,
        aborted=sum(r["aborted"] for r in rows))


def markdown(result: dict) -> str:
    lines = ["# End to end: a GRPO rollout step, rhymerl vs a plain engine\n",
             f"- device: {result['device']} ({result['ratio_kind']})", f"- commit: {result['commit']}",
             f"- command: `{result['command']}`", f"- setting: {result['setting']}",
             f"- baseline: {result['baseline']}", f"- rhymerl: {result['rhymerl']}\n",
             markdown_table(result["epochs"], COLUMNS) + "\n"]
    if result["mean_ratio"] is not None:
        lines.append(f"**Mean ratio (baseline s / rhymerl s): {result['mean_ratio']:.2f}** over "
                     f"{len(result['epochs'])} epochs; {_fmt(result['mean_ratio_with_history'])} over the epochs with history; whole run "
                     f"{_fmt(result['total_ratio'])}. Samples identical between the two systems: "
                     f"{_fmt(result['mean_identical_share'], '{:.1%}')}; lost samples: {result['aborted']}.\n")
    lines += [f"- {note}" for note in result["notes"]]
    parts = [dict(b, epoch=r["epoch"]) for r in result["epochs"] for b in r.get("breakdown", [])]
    if parts:
        lines += ["\n## Where the time went\n",
                  "Workers summed, from their /metrics over each system's rollout call: engine steps by kind "
                  "(prefill = any prompt token fed), their seconds and mean ms, forwards that ran eagerly (no "
                  "CUDA graph; every forward on a CPU), prompt tokens prefilled (resumed chunks included). "
                  "Engine share: step seconds over the wall time; the rest is the service path or idle "
                  "workers.\n", markdown_table(parts, BREAKDOWN)]
    return "\n".join(lines) + "\n"


def _fmt(x, spec: str = "{:.2f}") -> str:
    return "n/a" if x is None else spec.format(x)


def write(out: Path, result: dict) -> None:
    """e2e.{json,md}; e2e_smollm2.{json,md} for the real pretrained policy."""
    write_results(out, "e2e_smollm2" if result.get("task") == "words" else "e2e", result, markdown(result))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--workers", type=int, default=2, help="rollout workers per system")
    p.add_argument("--epochs", type=int, default=5, help="GRPO epochs (each is one rollout step per system)")
    p.add_argument("--prompts", type=int, default=32, help="the first N prompts of the recorded set (32)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=768)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny",
                   help="tiny: the policy trained here on the synthetic task (recorded prompts); smollm2: "
                        "SmolLM2-135M-Instruct on English word problems (make model-smollm2)")
    p.add_argument("--model-dir", help="default: models/small on CUDA when trained, else models/tiny; "
                                       "with --model smollm2: models/smollm2-135m")
    p.add_argument("--dtype", help="worker dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--kv-blocks", type=int, default=1024, help="KV-cache blocks of 16 tokens per worker")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no epoch after this many seconds (0: none)")
    p.add_argument("--chunk-tokens", type=int, default=0,
                   help="rhymerl's divided rollout: tokens per chunk (0: the scheduler's default for the policy, "
                        "as shipped)")
    p.add_argument("--widen", help="serve the policy widened to this shape (Qwen2.5-0.5B, Qwen2.5-1.5B, or "
                                    "NAME=hidden,intermediate,layers,heads,kv_heads,head_dim,vocab)")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.model == "smollm2" and args.widen:
        p.error("--widen widens the tiny policy; --model smollm2 is served at its own shape")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    small = ROOT / "models" / "small"
    model_dir = args.model_dir or str(small if args.device == "cuda" and (small / "config.json").exists()
                                      else ROOT / "models" / "tiny")
    task = {}  # the example trainer's options for the model
    if args.model == "smollm2":
        model_dir = args.model_dir or str(ROOT / "models" / "smollm2-135m")
        if not (Path(model_dir) / "config.json").exists():  # written by devtools (benchmarks never import them)
            print(f"e2e_bench --model smollm2: no checkpoint at {model_dir}: run `make model-smollm2` first",
                  file=sys.stderr)
            return 2
        task = {"task": "words", "train_layers": 2}
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("e2e_bench --device cuda: no CUDA device (torch.cuda.is_available() is False); nothing measured",
                  file=sys.stderr)
            return 2
        device_name = torch.cuda.get_device_name()
    else:
        device_name = f"{cpu_name()} CPU"
    if Path(model_dir) == ROOT / "models" / "tiny":
        ensure_model(model_dir)  # trained on first use, as `make run` does
    elif not (Path(model_dir) / "config.json").exists():
        print(f"e2e_bench: no checkpoint at {model_dir}", file=sys.stderr)
        return 2
    # The tiny policy's prompts must be the recorded set's; the word problems are generated from the seed.
    recorded = None if task else {r.prompt_id: [int(t) for t in r.prompt_token_ids] for r in read_traces(RECORDED)}
    tmp = tempfile.TemporaryDirectory(prefix="e2e-")
    worker_dir, shape = model_dir, None
    if args.widen:
        import torch

        from benchmarks.spec_sweep import parse_shape
        from services.rollout.models.widen import widen_checkpoint

        _, shape = parse_shape(args.widen)
        worker_dir = str(Path(tmp.name, "widened"))
        started = time.monotonic()
        widen_checkpoint(model_dir, worker_dir, shape, seed=0, device=args.device, dtype=getattr(torch, args.dtype))
        print(f"{model_dir} widened to {args.widen} in {time.monotonic() - started:.0f} s", flush=True)
    meta = dict(
        device=device_name, workers=args.workers, commit=git_commit(),
        command=" ".join(["python -m benchmarks.e2e_bench", *argv]),
        ratio_kind=f"a CPU ratio: both systems' workers and the trainer share {os.cpu_count()} CPU cores"
        if args.device == "cpu" else "GPU ratio: the workers share one GPU",
        model=Path(model_dir).name, task=task.get("task", "reasoning"), dtype=args.dtype, model_shape=model_shape(worker_dir, args.widen),
        setting=f"{args.prompts} {'word-problem' if task else 'recorded'} prompts x {args.n} samples, max {args.max_tokens} tokens, T=1, "
                f"{args.workers} workers per system, model {Path(model_dir).name}"
                f"{f' widened to {args.widen}' if args.widen else ''} ({args.dtype}), "
                f"GRPO updates between epochs (lr 2e-4, 2 updates, partial credit 0.5"
                f"{', last 2 layers trained' if task else ''})",
        baseline="static placement, workers without speculation",
        rhymerl="rhymerl placement (" + (f"chunks of {args.chunk_tokens} tokens" if args.chunk_tokens else
                                        "the scheduler's default chunks") + "), history drafts",
        chunk_tokens=args.chunk_tokens or None,
        notes=[
            "Wall time is the trainer's rollout call (submit to the last sample), one system at a time, "
            "alternating which goes first.",
            "Both systems sample the same policy with the same seeds; the identical share counts the samples "
            "whose tokens are the same in both. This run does not measure why any differ (docs/sampling.md "
            "says what each worker mode guarantees).",
        ] + ([f"CPU timing on a machine shared with other jobs (load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} cores at the start): single epochs' ratios are noisy; the whole-run ratio is "
              f"the steadier figure."] if args.device == "cpu" else []))
    rows: list[dict] = []
    out = Path(args.out)
    start = time.monotonic()
    # SIGTERM (a time limit) unwinds: both clusters stop their processes; finished epochs are written.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    trainer = load_example("grpo_trainer")
    from rhymerl import RolloutClient

    with tmp:
        env = cluster_env(args)
        base = LocalCluster(model_dir=worker_dir, num_workers=args.workers, policy="static",
                            log_dir=Path(tmp.name, "b"), extra_env={**env, "RHYMERL_WORKER_SPECULATIVE": "false"})
        ours = LocalCluster(model_dir=worker_dir, num_workers=args.workers, policy="rhymerl",
                            chunk_tokens=args.chunk_tokens, log_dir=Path(tmp.name, "r"), extra_env=env)
        with base, ours, RolloutClient(base.scheduler_address) as b, RolloutClient(ours.scheduler_address) as r:
            print(f"both systems up after {time.monotonic() - start:.0f} s; {args.epochs} epochs", flush=True)

            counters = {"baseline": base.engine_counters(), "rhymerl": ours.engine_counters()}

            def on_epoch(epoch: int, base_step: TimedStep, ours_step: TimedStep) -> None:
                rows.append(epoch_row(epoch, base_step, ours_step))
                rows[-1]["breakdown"] = []
                for system, cluster, step in (("baseline", base, base_step), ("rhymerl", ours, ours_step)):
                    now = cluster.engine_counters()
                    rows[-1]["breakdown"].append(breakdown(epoch, system, step.wall_s, counters[system], now))
                    counters[system] = now
                print(" | ".join(f"{title} {fmt.format(rows[-1][key])}" for title, key, fmt in COLUMNS),
                      flush=True)
                write(out, summarize(args, rows, meta))
                if args.budget_s and time.monotonic() - start > args.budget_s and epoch + 1 < args.epochs:
                    raise TimeoutError(f"--budget-s {args.budget_s:.0f} reached after epoch {epoch}")

            client = PairedClient(b, r, recorded_prompts=recorded, on_epoch=on_epoch)
            if shape is not None:
                from services.rollout.loader import read_config

                client = WidenedPushes(client, read_config(model_dir), shape, args.device, args.dtype)
            try:
                stats = trainer.run(client, model_dir, steps=args.epochs, num_prompts=args.prompts, n=args.n,
                                    max_tokens=args.max_tokens, partial_credit=0.5, device=args.device, **task,
                                    log=lambda line: print("  trainer: " + line, flush=True))
                for row, step in zip(rows, stats):
                    row["reward"] = step["reward"]
            except TimeoutError as exc:
                print(exc, flush=True)
    result = summarize(args, rows, meta)
    write(out, result)
    print(markdown(result))
    if not rows or result["aborted"]:
        print(f"e2e_bench: {'no epoch completed' if not rows else str(result['aborted']) + ' samples lost'}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
