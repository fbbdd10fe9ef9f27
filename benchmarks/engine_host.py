"""How much host (Python) time does one engine step cost, phase by phase?

    python -m benchmarks.engine_host                          # this tree
    python -m benchmarks.engine_host --before 76be091         # and a baseline commit, side by side

On a GPU the decode forward is a CUDA-graph replay of a few milliseconds at most; what the
engine does around it in Python (schedule, prepare the step's inputs, verify's
bookkeeping, commit each sequence's tokens) adds to every step. Here the model is a
random 1-layer, 64-wide one on the CPU, so the forward is negligible and what is left is
that host work. Each phase is timed in this thread's CPU time (``time.thread_time``: on a
shared machine, time other processes take the core from the step does not count; torch
runs on this one thread) by wrapping the engine's methods from outside (no timing code in
the engine):
  schedule  BatchScheduler.schedule
  draft     LLMEngine._propose_drafts (the drafter below is a dictionary lookup)
  prepare   ModelRunner.prepare (the step's flat inputs and attention metadata)
  forward   ModelRunner.run minus prepare (the model, the logits)
  verify    verify() (or sample_rows() / sample_arrays() on steps without drafts, verify_linear() on
            decode-layout steps, where the measured tree has them) minus the sampler
            (kernels.sampling.sample, whose CPU reference
            computes Gumbel noise in PyTorch; on a GPU a Triton kernel does it), i.e.
            the sampling rows, the verdicts
  commit    the rest of step(): postprocess, commit each sequence's tokens, finish,
            metrics
  deferred  EngineMetrics.flush, BlockManager.hash_filled and VerifyStats.apply, where
            the measured tree has them: the last step's metric exports, the hashing of the
            blocks its commit filled and its verify counts summed by slot, run after this step's forward is launched (on a GPU they overlap the
            forward: the host does them while the device computes); a tree without them
            does that work inside commit. On a step launched on the last step's tokens
            straight from the device (the overlapped decode without drafts, engine.py, where
            the measured tree has it), also that last step's read and commit
            (``LLMEngine._resolve``), which the host does while the forward runs; where the
            step could not be overlapped, the resolve before its schedule stays in commit.
            With ``--gc worker`` (the default), also the garbage
            collections a worker's engine runs at the same point (its StepCollector,
            services/common/gc_tuning.py, where the measured tree has one: this process's
            collector is then set up as a worker's, start-up objects frozen and automatic
            collections deferred; a tree without it collects wherever Python allocates, as
            its worker did). ``--gc cpython`` leaves CPython's collector as it is.
"host" is schedule + draft + prepare + verify + commit (what the device waits for);
"host + deferred" adds the deferred work back; "without draft" leaves out the
drafter's share (a dictionary lookup here, a real drafter's cost elsewhere). Only full-batch decode/verify
steps count (no prefill, no sequence finished yet); each phase's figure is its mean
over those steps, from the fastest of ``--repeats`` runs (by host time).

Workloads at batch 1, 16, 64 and 256 (20-token prompts, 64 new tokens, greedy):
  decode  no speculation, one token per sequence per step;
  verify  a drafter that proposes the next ``--draft-len`` tokens of each request's own
          earlier greedy output (mostly accepted), under a flat cost model so the budget
          never cuts them.
With ``--before COMMIT`` the same measurement also runs on that commit's code (its
files exported with ``git archive`` to a temporary directory, this script copied in, the
compiled kernels its sources have built there):
the two trees alternate, one run each per round for ``--repeats`` rounds (a shared
machine's load drifts; alternating makes the drift hit both), and the table shows both.

Writes benchmarks/results/engine_host.md and .json.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.engine_run import ContinuationDrafter
from benchmarks.provenance import REPO, cpu_name, git_commit
from benchmarks.report import markdown_table, write_results

RESULTS = Path(__file__).resolve().parent / "results"
_clock = time.thread_time
PHASES = ("schedule", "draft", "prepare", "forward", "verify", "sample", "commit", "deferred")
HOST = ("schedule", "draft", "prepare", "verify", "commit")
WORKER_COLLECTOR = None  # this process's garbage collector as a worker's (--gc worker, worker_gc)


def worker_gc() -> None:
    """Sets this process's garbage collector up as a worker's (services/rollout/server.py
    worker_collector); a tree from before the worker's collector existed keeps CPython's."""
    global WORKER_COLLECTOR
    try:
        from services.rollout.server import worker_collector
    except ImportError:
        return
    from services.rollout.settings import WorkerSettings

    WORKER_COLLECTOR = worker_collector(WorkerSettings())


def tiny_model():
    from services.rollout.loader import init_random_model
    from services.rollout.models.config import ModelConfig

    cfg = ModelConfig(
        architecture="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_scaling=None, max_position_embeddings=1024, tie_word_embeddings=False, attention_bias=True,
        qk_norm=False, eos_token_ids=(0,), bos_token_id=None, dtype="float32")
    return init_random_model(cfg, seed=0)


def requests(batch: int, new_tokens: int):
    from services.rollout.engine import EngineRequest

    return [EngineRequest(
        request_id=f"r{i}", prompt_id=f"p{i}", step_id="s0", sample_index=0,
        prompt_token_ids=[1 + (7 * j + 3 * i) % 500 for j in range(20)], generated_token_ids=[],
        temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=1000 + i, max_tokens=new_tokens,
        max_new_tokens=new_tokens, stop_token_ids=frozenset(), min_tokens=0, ignore_eos=True, logprobs=True)
        for i in range(batch)]


def measure(model, batch: int, new_tokens: int, draft_len: int, continuations=None) -> tuple[dict, dict]:
    """One run; returns (mean ms per phase over the counted steps, each request's tokens)."""
    import services.rollout.engine.engine as engine_module
    import services.rollout.engine.verifier as verifier_module
    from services.rollout.engine import CostModel, LLMEngine

    drafter = ContinuationDrafter(continuations) if continuations else None
    engine = LLMEngine(model, device="cpu", num_kv_blocks=4096, block_size=16, max_num_seqs=256,
                       max_num_batched_tokens=8192, drafter=drafter, speculative=drafter is not None,
                       max_draft_len=draft_len, cost_model=CostModel([(1, 1.0), (1 << 20, 1.0)]),
                       measure_cost=False)
    step_times: dict[str, float] = {}
    totals = {p: 0.0 for p in PHASES}
    counted = [0]

    def timed(name, fn):
        def wrapper(*args, **kw):
            t = _clock()
            try:
                return fn(*args, **kw)
            finally:
                step_times[name] = step_times.get(name, 0.0) + _clock() - t
        return wrapper

    def schedule(fn):
        def wrapper(*args):  # (a tree's schedule may take the last step's layout)
            out = fn(*args)
            step_times["full"] = len(out.seqs) == batch and out.num_decodes == batch
            return out
        return timed("schedule", wrapper)

    engine.scheduler.schedule = schedule(engine.scheduler.schedule)
    engine._propose_drafts = timed("draft", engine._propose_drafts)
    engine.runner.prepare = timed("prepare", engine.runner.prepare)
    engine.runner.run = timed("run", engine.runner.run)
    saved = engine_module.verify, verifier_module.sample
    # Other ways the engine verifies, where the measured tree has them: draftless steps
    # sampled without verdicts (sample_rows, or sample_arrays), decode-layout steps
    # accepted by array operations (verify_linear).
    other = {name: getattr(engine_module, name) for name in ("sample_rows", "sample_arrays", "sample_later",
                                                             "verify_linear") if hasattr(engine_module, name)}
    engine_module.verify = timed("verify_all", engine_module.verify)
    for name, fn in other.items():
        setattr(engine_module, name, timed("verify_all", fn))
    verifier_module.sample = timed("sample", verifier_module.sample)
    if hasattr(engine.metrics, "flush"):
        engine.metrics.flush = timed("deferred", engine.metrics.flush)
    if hasattr(engine.block_manager, "hash_filled"):
        engine.block_manager.hash_filled = timed("deferred", engine.block_manager.hash_filled)
    if hasattr(getattr(engine, "_verify_stats", None), "apply"):
        engine._verify_stats.apply = timed("deferred", engine._verify_stats.apply)
    if hasattr(engine, "_resolve"):  # a step's tokens read and committed after the next forward's launch
        engine._resolve = timed("resolve", engine._resolve)
    if WORKER_COLLECTOR is not None and hasattr(engine, "collector"):
        engine.collector = timed("deferred", WORKER_COLLECTOR)
    try:
        for r in requests(batch, new_tokens):
            engine.add_request(r)
        # Each run's steps start from a collected heap, as a worker's do long after start-up
        # (the new engine's own objects are no young garbage to its first steps' collections).
        gc.collect()
        outputs = {}
        while engine.has_unfinished():
            step_times.clear()
            t = _clock()
            done = engine.step()
            step_s = _clock() - t
            for o in done:
                outputs[o.request_id] = o
            if step_times.get("full") and not done:
                s = {k: v for k, v in step_times.items() if k != "full"}
                parts = dict(schedule=s["schedule"], draft=s.get("draft", 0.0), prepare=s["prepare"],
                             forward=s["run"] - s["prepare"], verify=s["verify_all"] - s.get("sample", 0.0),
                             sample=s.get("sample", 0.0))
                # the last step's resolve: deferred where this step's forward fed its tokens
                # (the overlap), the host's where it ran before this step's schedule
                overlapped = getattr(engine.runner, "fed_device_tokens", False)
                parts["deferred"] = s.get("deferred", 0.0) + (s.get("resolve", 0.0) if overlapped else 0.0)
                parts["commit"] = (step_s - s["schedule"] - s.get("draft", 0.0) - s["run"] - s["verify_all"]
                                   - parts["deferred"])
                for p in PHASES:
                    totals[p] += parts[p]
                counted[0] += 1
    finally:
        engine_module.verify, verifier_module.sample = saved
        for name, fn in other.items():
            setattr(engine_module, name, fn)
    n = max(counted[0], 1)
    ms = {p: totals[p] / n * 1e3 for p in PHASES}
    ms["host"] = sum(ms[p] for p in HOST)
    ms["host_deferred"] = ms["host"] + ms["deferred"]
    ms["steps"] = counted[0]
    c = engine.metrics.counters
    ms["accepted"] = c.num_accepted_tokens / c.num_draft_tokens if c.num_draft_tokens else 0.0
    return ms, {r: o.token_ids for r, o in outputs.items()}


def measure_all(batches, new_tokens: int, draft_len: int, repeats: int) -> list[dict]:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = tiny_model()
    rows = []
    for batch in batches:
        greedy = None
        for workload in ("decode", "verify"):
            best = None
            for _ in range(repeats):
                ms, tokens = measure(model, batch, new_tokens, draft_len if workload == "verify" else 0,
                                     greedy if workload == "verify" else None)
                greedy = greedy or tokens
                if best is None or ms["host"] < best["host"]:
                    best = ms
            rows.append(dict(workload=workload, batch=batch, **best))
            print(f"{workload:6s} batch {batch:3d}: host {best['host']:.3f} ms/step "
                  + " ".join(f"{p} {best[p]:.3f}" for p in PHASES), flush=True)
    return rows


# The compiled libraries a tree's `make install` builds for the engine's CPU path (kernels
# it loads with ctypes): (source, build.py arguments, library). Build output is not in git.
NATIVE_LIBS = (("kernels/native/attention.cpp", ["--target", "attention"], "kernels/native/libattention.so"),
               ("kernels/native/gumbel.cpp", ["--target", "gumbel"], "kernels/native/libgumbel.so"))
BUILD_SCRIPT = "services/rollout/drafter/native/build.py"


def build_native(tree: Path) -> list[str]:
    """Builds in ``tree`` (an export of a commit) the libraries of NATIVE_LIBS its sources
    have, with its own build script, as its ``make install`` would: without them its
    kernels would fall back to their PyTorch references and the tree would be measured
    slower than it runs. Returns the libraries built."""
    built = []
    for source, args, lib in NATIVE_LIBS:
        if (tree / source).exists() and (tree / BUILD_SCRIPT).exists():
            subprocess.run([sys.executable, BUILD_SCRIPT, *args, "--force", "--out", lib], cwd=tree, check=True,
                           stdout=subprocess.DEVNULL)
            built.append(lib)
    return built


def run_before(commit: str, argv: list[str]) -> tuple[str, list[dict]]:
    """This script's measurement on ``commit``'s code, in a temporary export of it (its
    compiled kernels built: ``build_native``)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", commit], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        build_native(Path(tmp))
        shutil.copy(Path(__file__), Path(tmp) / "benchmarks" / "engine_host.py")
        out = Path(tmp) / "before.json"
        subprocess.run([sys.executable, "-m", "benchmarks.engine_host", *argv, "--json-only", str(out)],
                       cwd=tmp, check=True)
        short = subprocess.run(["git", "rev-parse", "--short", commit], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
        return short, json.loads(out.read_text())


def fastest(runs: list[list[dict]]) -> list[dict]:
    """Per (workload, batch), the row of the run with the least host time."""
    best: dict = {}
    for rows in runs:
        for row in rows:
            key = row["workload"], row["batch"]
            if key not in best or row["host"] < best[key]["host"]:
                best[key] = row
    return list(best.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", help="a commit to measure first, shown beside this tree's figures")
    ap.add_argument("--json-only", help=argparse.SUPPRESS)  # run_before's child: rows to this file
    ap.add_argument("--gc", choices=("worker", "cpython"), default="worker",
                    help="the garbage collector as a worker runs it (where the tree has that), or CPython's")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.gc == "worker":
        worker_gc()
    common = ["--gc", args.gc, "--batches", *map(str, args.batches), "--new-tokens", str(args.new_tokens),
              "--draft-len", str(args.draft_len), "--repeats", str(args.repeats)]
    if args.json_only:
        Path(args.json_only).write_text(json.dumps(measure_all(args.batches, args.new_tokens, args.draft_len,
                                                               args.repeats)))
        return
    if args.before:  # alternate the two trees, one run each per round, so load drift hits both
        once = [*common[:-1], "1"]
        before_runs, runs = [], []
        for _ in range(args.repeats):
            before_commit, rows = run_before(args.before, once)
            before_runs.append(rows)
            runs.append(measure_all(args.batches, args.new_tokens, args.draft_len, 1))
        before, rows = fastest(before_runs), fastest(runs)
    else:
        before_commit, before = None, []
        rows = measure_all(args.batches, args.new_tokens, args.draft_len, args.repeats)
    commit = git_commit("services", "kernels", "benchmarks")
    for row in rows:
        old = next((b for b in before if (b["workload"], b["batch"]) == (row["workload"], row["batch"])), None)
        row["host_before"] = old["host"] if old else None
        row["speedup"] = old["host"] / row["host"] if old else None
        row["share"] = row["host"] / old["host"] if old else None
        row["share_deferred"] = row["host_deferred"] / old["host"] if old else None
        row["bookkeeping"] = row["host"] - row["draft"]
        row["bookkeeping_before"] = old["host"] - old["draft"] if old else None
        row["bookkeeping_speedup"] = row["bookkeeping_before"] / row["bookkeeping"] if old else None
    columns = [("workload", "workload", "{}"), ("batch", "batch", "{}"), ("accepted", "accepted", "{:.2f}")]
    columns += [(f"{p} ms", p, "{:.3f}") for p in PHASES] + [("host ms", "host", "{:.3f}"),
                                                             ("host + deferred ms", "host_deferred", "{:.3f}")]
    meta = dict(device=f"cpu ({cpu_name()}, 1 torch thread)", commit=commit,
                command="python -m benchmarks.engine_host " + " ".join(sys.argv[1:]),
                torch=torch.__version__, before_commit=before_commit, garbage_collector=args.gc)
    text = [f"# Engine host time per step\n\ndevice: {meta['device']}; commit {commit}; torch {torch.__version__}",
            f"command: `{meta['command']}`",
            "accepted: the share of draft tokens accepted. Model: random, 1 layer, hidden 64 (the forward is negligible); ms per full-batch decode/verify "
            "step, mean over the steps of the fastest run. host = schedule + draft + prepare + verify + commit "
            "(verify without the sampler, `sample`); deferred: the metric exports, block hashing and verify counts the engine "
            "runs after launching the next forward (overlapped on a GPU; a tree without them does that inside "
            "commit), on steps launched on the last step's tokens from the device (the overlapped decode, where "
            "the tree has it) that last step's read and commit (`LLMEngine._resolve`), and "
            f"with --gc worker the garbage collections a worker's engine runs there (this run: --gc {args.gc}). "
            "See the docstring of benchmarks/engine_host.py.",
            f"## This tree ({commit})\n\n" + markdown_table(rows, columns)]
    if before:
        text.append(f"## Before (commit {before_commit})\n\n" + markdown_table(before, columns))
        text.append("## Host ms per step, before vs after\n\n" + markdown_table(
            rows, [("workload", "workload", "{}"), ("batch", "batch", "{}"),
                   (f"before ({before_commit})", "host_before", "{:.3f}"), (f"after ({commit})", "host", "{:.3f}"),
                   ("speedup", "speedup", "{:.2f}x"), ("after / before", "share", "{:.0%}"),
                   ("after + deferred", "host_deferred", "{:.3f}"), ("/ before", "share_deferred", "{:.0%}"),
                   ("without draft: before", "bookkeeping_before", "{:.3f}"),
                   ("after", "bookkeeping", "{:.3f}"), ("speedup", "bookkeeping_speedup", "{:.2f}x")]))
    write_results(args.out, "engine_host", dict(**meta, rows=rows, before=before), "\n\n".join(text) + "\n")
    print("\n\n".join(text[3:]))


if __name__ == "__main__":
    main()
