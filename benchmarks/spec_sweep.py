"""How much faster does speculation make the engine at real model shapes?

    python -m benchmarks.spec_sweep --device cuda          # the GPU campaign's sweep (docs/gpu.md)
    python -m benchmarks.spec_sweep --dry-run ...          # the CPU rehearsal (tests/deploy): tiny shapes

The tiny trained policy (models/tiny) widened to each shape (services/rollout/models/widen.py:
the same function, a real shape's cost), on the recorded GRPO prompts of
benchmarks/data/tiny_grpo_cpu.npz, T=1, at batch 1, 16 and 128 (1 prompt x 1, 4 x 4, 32 x 4
samples), the same seeds in every run, in two settings, each with its own plain run:

- stop `EOS` (a GRPO rollout: a sample ends at EOS or max tokens): plain, and `history`,
  the worker's drafter (the compiled core) fed the recorded earlier epochs' responses (the
  policy's rhyme), with the worker's default draft budget; at the tail's batches (up to
  `DrafterConfig.tree_max_batch`, 16) also `history-tree`, the same drafter offering draft
  trees (issue 27: tail steps faster with trees than with linear drafts);
- stop `max` (no stop token: every sample generates exactly max tokens, so every run does
  the same work): plain, and `oracle k`, the plain run's own tokens (the same seeds give
  the exact future) cut so that k tokens (1.5 and 2.5 on average, --cuts) are drafted, and
  accepted, per verify; the draft budget is off. This measures the engine's conversion of
  acceptance into speed apart from the policy's rhyme.

The speedup is per generated token: a run's tokens/s over its plain run's. Plain seconds
over the run's seconds (`wall_ratio_vs_plain`) is kept beside it; it is the same figure
only when both generated the same tokens. On a GPU (bfloat16) a verify forward over k+1
tokens need not round a logit as the one-token decode forward does, so a sample can leave
plain's path at a near-tie and end at another length: the H200 sweep of 2026-11-26 compared
a 48-token run with a 256-token one and read 6.46x for 1.2x the tokens/s. (Most of that
day's divergence is explained by a bug found afterwards and fixed, not yet confirmed on a
GPU: each LLMEngine's model.to() replaced the RoPE buffer that the earlier engines' CUDA
graphs read, so the plain engine decoded with freed memory; docs/gpu.md.) The `max` setting makes the oracle's work equal by construction, so
there the two ratios agree. History keeps EOS (after EOS the rhyme it drafts is not a
rollout's), so its ratio is per token and a row whose tokens are off plain's by more than
10% gets no verdict on its target.

An oracle row records its accepted tokens per verify over its cut (`cut_reached`): once a
sample leaves plain's path every later draft of it is rejected, and a row below 80% of its
cut measured something else: its target gets no verdict ("does not measure its target"),
never met / not met. Batch-invariant mode would make decode and verify bitwise equal but
changes the kernels' speed (docs/sampling.md: 1.16x at a GRPO batch on an H100), so the
sweep measures the default mode and reports how far each oracle got.

Every configuration runs once untimed first (compiles, graph captures). Per row: tokens,
tokens/s, speedup, wall ratio, accepted tokens per verify (and its share of the cut), steps,
and the share of samples identical to plain's. Per shape: the widened model's forward time
beside a random-weight model's of the same shape (the widened one is partly exact zeros).
Writes benchmarks/results/<device>/spec_sweep.{md,json} after each shape (a cut-short run
keeps what it measured); --dry-run writes only to --out and marks the file as not a
measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import sys
import time
from pathlib import Path

import torch

from benchmarks.engine_grpo import TRACES, grpo_requests
from benchmarks.engine_run import ContinuationDrafter, run_engine
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table, write_results
from services.rollout.drafter import DrafterConfig
from services.rollout.drafter.compiled import make_drafter
from services.rollout.engine import CostModel, LLMEngine
from services.rollout.loader import init_random_model, load_model
from services.rollout.models.base import DenseCausalAttention
from services.rollout.models.widen import SHAPES, Shape, named_shape, widen_model, zero_share

RESULTS = Path(__file__).resolve().parent / "results"
ORACLE_CUTS = (1.5, 2.5)  # issue 26's targets name these two
# issue 26's targets at the 1.5B shape: speedup vs plain, by drafter and batch
TARGETS = {"history": {1: 1.0, 16: 1.0, 128: 1.0}, "oracle 1.5": {1: 2.2, 16: 2.0, 128: 1.3},
           "oracle 2.5": {1: 3.0, 16: 2.8, 128: 1.5}}
TARGET_SHAPE = "Qwen2.5-1.5B"
CUT_REACHED = 0.8  # an oracle row below 80% of its cut does not measure its target
SAME_WORK = 0.1  # a row whose token count is off plain's by more than 10% gets no verdict
COLUMNS = [("shape", "shape", "{}"), ("batch", "batch", "{}"), ("stop", "stop", "{}"), ("drafter", "drafter", "{}"),
           ("accepted/verify", "accepted_per_verify", "{:.2f}"), ("of cut", "of_cut", "{}"),
           ("tokens", "tokens", "{}"), ("tokens/s", "tokens_per_s", "{:.0f}"),
           ("speedup (per token)", "speedup_vs_plain", "{:.2f}"), ("wall ratio", "wall_ratio_vs_plain", "{:.2f}"),
           ("steps", "steps", "{}"), ("identical", "identical_share", "{:.2f}")]


class SwitchDrafter:
    """Delegates to `inner`, which the sweep swaps between runs (one engine, one set of
    CUDA graphs, several drafters)."""

    def __init__(self):
        self.inner = None

    def start_request(self, *a, **k):
        return self.inner.start_request(*a, **k)

    def add_tokens(self, *a, **k):
        return self.inner.add_tokens(*a, **k)

    def record_acceptance(self, *a, **k):
        return self.inner.record_acceptance(*a, **k)

    def stop_request(self, *a, **k):
        return self.inner.stop_request(*a, **k)

    def propose(self, *a, **k):
        return self.inner.propose(*a, **k)


class TreeSwitchDrafter(SwitchDrafter):
    """A SwitchDrafter an engine asks for draft trees (its own engine: whether an engine
    verifies trees is fixed when it is built)."""

    tree_drafts = True

    def propose_trees(self, *a, **k):
        return self.inner.propose_trees(*a, **k)

    def record_tree_acceptance(self, *a, **k):
        return self.inner.record_tree_acceptance(*a, **k)


class CutOracleDrafter(ContinuationDrafter):
    """The known continuation, `per_verify` tokens per proposal on average (1.5: 1, 2, 1, 2, ...)."""

    def __init__(self, continuations: dict[str, list[int]], per_verify: float):
        super().__init__(continuations)
        self.per_verify, self.proposals = per_verify, {}

    def propose(self, request_ids, max_lens, stop_token_ids=None, budget=None):
        drafts = []
        for r, n in zip(request_ids, max_lens):
            i = self.proposals.get(r, 0)
            self.proposals[r] = i + 1
            cut = math.floor((i + 1) * self.per_verify) - math.floor(i * self.per_verify)
            drafts.append(self.continuations[r][self.done[r]:self.done[r] + min(n, cut)])
        return drafts


def widened(model_dir: str, shape: Shape, device: str, dtype: torch.dtype):
    return widen_model(load_model(model_dir, "cpu", torch.float32), shape, seed=0, device=device, dtype=dtype)


def random_like(config, device: str, dtype: torch.dtype):
    if device == "cuda":
        from benchmarks.engine_gpu_steps import random_model_cuda

        return random_model_cuda(dataclasses.replace(config, dtype=str(dtype).removeprefix("torch.")))
    return init_random_model(dataclasses.replace(config, dtype=str(dtype).removeprefix("torch.")), seed=1)


@torch.inference_mode()
def forward_ms(model, batch: int, repeats: int) -> float:
    """One eager forward of `batch` one-token sequences plus the LM head, mean ms."""
    device = model.lm_head.weight.device
    ids = torch.randint(1, 40, (batch,), device=device)
    attn = DenseCausalAttention(torch.arange(batch + 1, device=device))
    positions = torch.zeros(batch, dtype=torch.long, device=device)

    def once():
        model.compute_logits(model(ids, positions, attn))

    once()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def history_of(records) -> dict[str, list[list[int]]]:
    last = max(r.epoch for r in records)
    history: dict[str, list[list[int]]] = {}
    for r in records:
        if r.epoch < last:
            history.setdefault(r.prompt_id, []).append([int(t) for t in r.token_ids])
    return history


def sweep_shape(name: str, model, records, batches, cuts, max_tokens: int, device: str, log=print) -> list[dict]:
    """At each batch (T=1, the same seeds throughout): plain and history stopping at EOS, then
    plain and the oracle cuts generating exactly `max_tokens` per sequence; one row per run."""
    eos = tuple(model.config.eos_token_ids)
    history = history_of(records)
    switch, tree_switch = SwitchDrafter(), TreeSwitchDrafter()
    tree_max_batch = DrafterConfig().tree_max_batch
    kw = dict(device=device, max_num_seqs=max(batches), max_num_batched_tokens=2048, block_size=16,
              num_kv_blocks=max(batches) * (-(-(max_tokens + 600) // 16)) + 16, max_draft_len=16)
    plain_engine = LLMEngine(model, speculative=False, **kw)
    history_engine = LLMEngine(model, drafter=switch, speculative=True, **kw)
    oracle_engine = LLMEngine(model, drafter=switch, speculative=True, cost_model=CostModel(tolerance=100.0), **kw)
    tree_engine = (LLMEngine(model, drafter=tree_switch, speculative=True, **kw)
                   if min(batches) <= tree_max_batch else None)

    def history_drafter(tree: bool = False):
        d = make_drafter("compiled", DrafterConfig(tree=tree))
        for prompt_id, responses in history.items():
            d.load_history(prompt_id, responses)
        return d

    def timed(engine, inner, reqs):
        switch.inner = tree_switch.inner = inner
        before = dataclasses.replace(engine.metrics.counters)
        outputs, seconds = run_engine(engine, reqs)
        c = engine.metrics.counters
        drafts, accepted = c.num_drafts - before.num_drafts, c.num_accepted_tokens - before.num_accepted_tokens
        return outputs, dict(seconds=seconds, steps=c.num_steps - before.num_steps, drafts=drafts,
                             draft_tokens=c.num_draft_tokens - before.num_draft_tokens, accepted_tokens=accepted,
                             accepted_per_verify=accepted / drafts if drafts else 0.0)

    rows = []
    for batch in batches:
        samples = 4 if batch % 4 == 0 else 1  # 16: 4 prompts x 4 samples, 128: 32 x 4
        prompts = batch // samples
        at_eos = grpo_requests(records, prompts, samples, 1.0, max_tokens, eos)
        # no stop token at all: exactly max_tokens each (the sampling is unchanged: EOS is a token like any)
        at_max = [dataclasses.replace(r, ignore_eos=True, stop_token_ids=frozenset()) for r in at_eos]
        warm = grpo_requests(records, prompts, samples, 1.0, min(16, max_tokens), eos)
        timed(plain_engine, None, warm)  # untimed first runs: compiles and captures out of the timings
        warmed = set()
        history_runs = [("history", None, history_engine, lambda plain_tokens: history_drafter())]
        if tree_engine is not None and batch <= tree_max_batch:
            history_runs.append(("history-tree", None, tree_engine, lambda plain_tokens: history_drafter(tree=True)))
        oracle_runs = [(f"oracle {k:g}", k, oracle_engine, lambda plain_tokens, k=k: CutOracleDrafter(plain_tokens, k))
                       for k in cuts]
        for stop, reqs, runs in (("EOS", at_eos, history_runs), ("max", at_max, oracle_runs)):
            plain, stats = timed(plain_engine, None, reqs)
            plain_tokens = {k: o.token_ids for k, o in plain.items()}
            base = dict(shape=name, batch=batch, stop=stop)
            rows.append(compared(dict(base, drafter="plain", cut=None, **stats), plain, plain, stats))
            log(rows[-1])
            for label, cut, engine, make in runs:
                if engine not in warmed:
                    timed(engine, make(plain_tokens), warm)
                    warmed.add(engine)
                outputs, run_stats = timed(engine, make(plain_tokens), reqs)
                rows.append(compared(dict(base, drafter=label, cut=cut, **run_stats), outputs, plain, stats))
                log(rows[-1])
    del plain_engine, history_engine, oracle_engine, tree_engine
    return rows


def compared(row: dict, outputs: dict, plain: dict, plain_stats: dict) -> dict:
    """`row` (a run's counters and seconds) with what it is compared by: its tokens and
    tokens/s; `speedup_vs_plain`, the ratio of tokens/s (the cost per generated token, what
    the targets use); `wall_ratio_vs_plain`, plain seconds / its seconds (the same figure
    only when both generated the same tokens: `tokens_vs_plain` 1); the share of samples
    identical to plain's; and for an oracle, `cut_reached`, its accepted per verify over
    its cut."""
    tokens, plain_tokens = (sum(len(o.token_ids) for o in out.values()) for out in (outputs, plain))
    per_s, plain_per_s = tokens / row["seconds"], plain_tokens / plain_stats["seconds"]
    cut = row.get("cut")
    return dict(row, tokens=tokens, plain_tokens=plain_tokens, tokens_vs_plain=tokens / plain_tokens,
                tokens_per_s=per_s, speedup_vs_plain=per_s / plain_per_s,
                wall_ratio_vs_plain=plain_stats["seconds"] / row["seconds"],
                identical_share=sum(outputs[k].token_ids == plain[k].token_ids for k in plain) / len(plain),
                cut_reached=row["accepted_per_verify"] / cut if cut else None)


def markdown(result: dict) -> str:
    lines = ["# Speculation at real model shapes (spec_sweep)\n",
             f"- device: {result['device']}", f"- commit: {result['commit']}", f"- command: `{result['command']}`",
             f"- setting: {result['setting']}\n"]
    if result.get("dry_run"):
        lines.append("**A dry run (tiny shapes, CPU): checks the sweep runs; not a measurement.**\n")
    shown = [dict(r, of_cut="–" if r.get("cut_reached") is None else f"{r['cut_reached']:.0%}") for r in result["rows"]]
    lines.append(markdown_table(shown, COLUMNS) + "\n")
    lines.append("Speedup: tokens/s over the tokens/s of plain at the same batch and stop (the cost per "
                 "generated token); wall ratio: plain seconds / its seconds. Stop `EOS`: a GRPO rollout, "
                 "sequences end at EOS or max tokens; `max`: EOS ignored, every sequence generates max tokens "
                 "(equal work: the two ratios agree). `of cut`: an oracle's accepted per verify over its cut.\n")
    lines.append("Targets (issue 26, 1.5B shape): " + "; ".join(target_text(t) for t in result.get("targets", [])) + "\n")
    for name, check in result["forward_check"].items():
        lines.append(f"- {name}: forward ms widened / random weights: "
                     + ", ".join(f"batch {b}: {v['widened_ms']:.3f} / {v['random_ms']:.3f}"
                                 for b, v in check["by_batch"].items())
                     + f" ({check['zero_share']:.1%} of the widened weights are exact zeros)")
    return "\n".join(lines) + "\n"


def target_text(t: dict) -> str:
    head = f"{t['drafter']} at batch {t['batch']}: {'>' if t['drafter'] == 'history' else '>='} {t['target']}x, "
    if t["measured"] is None:
        return head + t["reason"]
    if t["met"] is None:
        return head + f"{t['measured']:.2f}x, no verdict: {t['reason']}"
    return head + f"{t['measured']:.2f}x ({'met' if t['met'] else 'not met'})"


def run(model_dir: str, shapes: dict[str, Shape], device: str, out: Path, batches=(1, 16, 128),
        cuts=ORACLE_CUTS, max_tokens: int = 256, dry_run: bool = False, command: str = "") -> dict:
    from services.common.traces import read_traces

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    records = read_traces(TRACES)
    result = dict(
        device=torch.cuda.get_device_name() if device == "cuda" else f"{cpu_name()} CPU", commit=git_commit(),
        command=command, torch=torch.__version__, dry_run=dry_run, model_dir=Path(model_dir).name,
        setting=f"T=1, plain and history stop at EOS, plain and the oracle generate max tokens, max {max_tokens} "
                f"tokens, recorded prompts of {TRACES.name}, "
                f"{str(dtype).removeprefix('torch.')}, the policy widened to each shape",
        shapes={name: dataclasses.asdict(s) for name, s in shapes.items()}, rows=[], forward_check={})
    for name, shape in shapes.items():
        model = widened(model_dir, shape, device, dtype)
        check = {"zero_share": zero_share(model), "by_batch": {}}
        rand = random_like(model.config, device, dtype)
        for b in (1, max(batches)):
            check["by_batch"][b] = dict(widened_ms=forward_ms(model, b, 3 if dry_run else 20),
                                        random_ms=forward_ms(rand, b, 3 if dry_run else 20))
        del rand
        result["forward_check"][name] = check
        result["rows"] += sweep_shape(name, model, records, batches, cuts, max_tokens, device)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
        write(out, result)
    return result


def targets(rows: list[dict]) -> list[dict]:
    """Each target of issue 26 beside its measured speedup (per generated token) and a
    verdict, or None with the reason: no such row in this run; an oracle row that did not
    reach CUT_REACHED of its cut (its drafts were rejected: it measured something else);
    a row whose token count is off plain's by more than SAME_WORK (not the same work)."""
    found = {(r["shape"], r["drafter"], r["batch"]): r for r in rows}
    out = []
    for drafter, by_batch in TARGETS.items():
        for batch, target in by_batch.items():
            row = found.get((TARGET_SHAPE, drafter, batch))
            measured = None if row is None else row["speedup_vs_plain"]
            reason = "not measured in this run" if row is None else no_verdict(row)
            met = None if reason else measured > target if drafter == "history" else measured >= target
            out.append(dict(shape=TARGET_SHAPE, drafter=drafter, batch=batch, target=target, measured=measured,
                            met=met, reason=reason, cut_reached=None if row is None else row["cut_reached"],
                            tokens_vs_plain=None if row is None else row["tokens_vs_plain"]))
    return out


def no_verdict(row: dict) -> str | None:
    """Why `row`'s speedup says nothing about its target (None: it does)."""
    if row["cut_reached"] is not None and row["cut_reached"] < CUT_REACHED:
        return (f"does not measure its target: {row['accepted_per_verify']:.2f} accepted per verify, "
                f"{row['cut_reached']:.0%} of its cut {row['cut']:g} (below {CUT_REACHED:.0%})")
    if abs(row["tokens_vs_plain"] - 1) > SAME_WORK:
        return f"not the same work: {row['tokens_vs_plain']:.2f}x plain's tokens"
    return None


def write(out: Path, result: dict) -> None:
    result["targets"] = targets(result["rows"])
    write_results(out, "spec_sweep", result, markdown(result))


def parse_shape(text: str) -> tuple[str, Shape]:
    """A name of SHAPES, or NAME=hidden,intermediate,layers,heads,kv_heads,head_dim,vocab (tiny dry-run shapes)."""
    if "=" in text:
        name, dims = text.split("=", 1)
        return name, Shape(*(int(x) for x in dims.split(",")))
    return text, named_shape(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--model-dir", default="models/tiny")
    p.add_argument("--shape", action="append", help=f"{sorted(SHAPES)} or NAME=7 dims (default: both)")
    p.add_argument("--batches", default="1,16,128")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--cuts", default=",".join(f"{k:g}" for k in ORACLE_CUTS),
                   help="the oracle's accepted tokens per verify, comma-separated")
    p.add_argument("--dry-run", action="store_true", help="the CPU rehearsal: written to --out only, marked so")
    p.add_argument("--out", help="results folder (default benchmarks/results/<device>/)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("spec_sweep --device cuda: no CUDA device (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    if args.device == "cpu" and not args.dry_run:
        print("spec_sweep: on a CPU only --dry-run (its timings say nothing about GPUs)", file=sys.stderr)
        return 2
    if args.dry_run and not args.out:
        print("spec_sweep --dry-run: give --out (a dry run is never written into benchmarks/results)", file=sys.stderr)
        return 2
    from benchmarks.tiny_llm.checkpoint import ensure_model

    ensure_model(args.model_dir)
    out = Path(args.out) if args.out else RESULTS / _device_folder(torch.cuda.get_device_name())
    shapes = dict(parse_shape(s) for s in (args.shape or sorted(SHAPES, reverse=True)))  # 1.5B first
    if args.device == "cpu":
        torch.set_num_threads(1)  # a dry run on a shared machine
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # a time limit: unwind
    run(args.model_dir, shapes, args.device, out, tuple(int(b) for b in args.batches.split(",")),
        cuts=tuple(float(k) for k in args.cuts.split(",")), max_tokens=args.max_tokens, dry_run=args.dry_run,
        command=" ".join(["python -m benchmarks.spec_sweep", *argv]))
    print((out / "spec_sweep.md").read_text())
    return 0


def _device_folder(name: str) -> str:
    import re

    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


if __name__ == "__main__":
    sys.exit(main())
