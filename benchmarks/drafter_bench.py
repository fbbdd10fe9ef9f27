"""Draft tokens accepted per verify: rhymerl's drafter vs vLLM's suffix method and n-gram.

Every drafter goes through the same lockstep replay (`benchmarks.drafter_replay.replay`)
of each committed trace set: rhymerl (history + siblings + prompt + the global index of
recent responses, its draft length from the engine's cost curve at the replay's batch),
its single sources, vLLM's "suffix" method itself (ArcticInference's SuffixDecodingCache,
vLLM's defaults: global tree, max_spec_factor 1.0, min_token_prob 0.1; and one tree per
prompt) and vLLM's n-gram lookup. Then the rollout speedup each would bring at a steady
batch of 1, 16, 64 and 256 sequences, from the engine's cost curve (rhymerl replayed with
its cost threshold at that batch size; the peer drafts the same whatever the batch).

Draft trees (`rhymerl/tree`: the compiled drafter with DrafterConfig.tree, trees at batches
of at most 16) are compared with the peer on the epochs' tails (steps with at most 16
sequences left): accepted and verified draft tokens per sequence and step there
(`rhymerl_tree_mean_accepted`, `rhymerl_tree_verified_per_step`), and the modeled speedup
at each batch size (`modeled_speedup[B]["rhymerl_tree"]`); `rhymerl/tree-python` is the
same trees from the Python reference, for the drafter's time per sequence at the tail
(`rhymerl_tree_tail_propose_us`). --only-trees replays just those rows (the peer, rhymerl,
rhymerl/tree, rhymerl/tree-python) and writes drafter_trees.{md,json}.

    python -m benchmarks.drafter_bench [--traces A.npz B.npz ...] [--out benchmarks/results] [--only-trees]

The peer is built by `python -m benchmarks.peers.build_suffix_decoding` (make bench);
without it its rows are left out and the results say why. Without --traces, a synthetic
trace set is replayed.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import drafter_replay as R
from benchmarks.drafter_oracle import OracleDrafter
from benchmarks.peers.suffix_decoding import (
    MAX_CACHED_REQUESTS,
    MAX_TREE_DEPTH,
    PeerSuffixDrafter,
    PeerUnavailable,
    load_peer,
)
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table, write_results
from services.rollout.drafter import DrafterConfig, HistoDrafter
from services.rollout.drafter.compiled import CompiledDrafter
from services.rollout.engine.cost_model import CostModel

BATCH_SIZES = (1, 16, 64, 256)
RHYMERL = "rhymerl"  # the product configuration, as a worker runs it (the compiled core)
RHYMERL_PYTHON = "rhymerl/python"  # the same on the Python reference (HistoDrafter): same drafts, its speed
RHYMERL_TREE = "rhymerl/tree"  # draft trees at the tail (the compiled core, DrafterConfig.tree)
RHYMERL_TREE_PYTHON = "rhymerl/tree-python"  # the same trees from the Python reference: its speed
PEER, PEER_PER_PROMPT = "vllm-suffix", "vllm-suffix/per-prompt"
FLOOR = "floor"  # the replay's calls with one empty C crossing each and no drafting: what timing them costs
ORACLE, ORACLE_LONGEST = "oracle/any-context", "oracle/longest-context"
COMMITTED = ["benchmarks/data/tiny_grpo_service.npz", "benchmarks/data/tiny_grpo_service_t07.npz",
             "benchmarks/data/smollm2_grpo.npz"]


def _ours(backend: str = "compiled", **kw):
    """rhymerl's drafter with these settings: the compiled core (the worker's default; the
    same drafts as the reference, tested) or the Python reference."""
    config = DrafterConfig(**kw)
    return (lambda: CompiledDrafter(config)) if backend == "compiled" else (lambda: HistoDrafter(config))


def backend(config: str) -> str:
    """What implements a row: compiled / python (rhymerl's), peer, ngram or oracle."""
    if config.startswith(("vllm-suffix",)):
        return "peer"
    if config.startswith(("ngram", "oracle")):
        return config.split("/")[0]
    return "python" if config in (RHYMERL_PYTHON, RHYMERL_TREE_PYTHON) else "compiled"


def configs(peer, only_trees: bool = False) -> dict[str, object]:
    """name -> drafter factory, in table order (``only_trees``: the rows the tree figures need)."""
    fixed = {"min_gain": 0.0}
    out = {f"ngram/{k}": (lambda k=k: R.NgramDrafter(k)) for k in (4, 8, 16)}
    out |= {
        "history/16": _ours(use_siblings=False, use_prompt=False, use_global=False, **fixed),
        "siblings/16": _ours(use_history=False, use_prompt=False, use_global=False, **fixed),
        "global/16": _ours(use_history=False, use_siblings=False, use_prompt=False, **fixed),
        "per-prompt/16": _ours(use_global=False, **fixed),
        "per-prompt/adaptive": _ours(use_global=False, cost_model=CostModel()),
        "all/16": _ours(**fixed),
        "all+reward/adaptive": _ours(reward_weighting=True, cost_model=CostModel()),
        RHYMERL: _ours(cost_model=CostModel()),
        RHYMERL_PYTHON: _ours("python", cost_model=CostModel()),
        RHYMERL_TREE: _ours(cost_model=CostModel(), tree=True),
        RHYMERL_TREE_PYTHON: _ours("python", cost_model=CostModel(), tree=True),
    }
    if only_trees:
        out = {k: out[k] for k in (RHYMERL, RHYMERL_TREE, RHYMERL_TREE_PYTHON)}
    if peer is not None:
        cache = lambda: peer(MAX_TREE_DEPTH, MAX_CACHED_REQUESTS)  # noqa: E731
        out[PEER] = lambda: PeerSuffixDrafter(cache)
        out[PEER_PER_PROMPT] = lambda: PeerSuffixDrafter(cache, per_prompt=True)
    return out


def tree_figures(traces: list[R.Trace], stop: int | None, by_name: dict) -> dict:
    """The tree drafter against the peer and the linear drafter on the epochs' tails, and
    its modeled speedup at each batch size (replayed with its cost threshold there: trees
    up to batch 16, its linear drafts above)."""
    tree, linear, peer = by_name[RHYMERL_TREE], by_name[RHYMERL], by_name.get(PEER)
    speedup = {}
    for batch in BATCH_SIZES:
        row = R.replay(traces, _ours(cost_model=CostModel(), tree=True), stop, f"{RHYMERL_TREE}@{batch}",
                       num_seqs=batch)
        speedup[str(batch)] = {
            "rhymerl_tree": R.modeled_speedup(batch, row["draft_tokens_per_step"], row["mean_accepted_drafts_per_step"]),
            "rhymerl_tree_accepted_per_verify": row["mean_accepted_drafts_per_step"],
            "rhymerl_tree_draft_per_verify": row["draft_tokens_per_step"],
        }
    tail = "tail_mean_accepted_drafts_per_step"
    python = by_name.get(RHYMERL_TREE_PYTHON)
    timing = lambda row: {k: row["drafter_step_us"][f"tail_{k}"] for k in ("propose_p50", "propose_p99")}  # noqa: E731
    return {
        "tail_batch": R.TAIL_BATCH,
        # the drafter's propose per sequence and step on the tail (thread CPU µs), compiled and Python
        "rhymerl_tree_tail_propose_us": {"compiled": timing(tree), "python": timing(python) if python else None},
        "rhymerl_tree_mean_accepted": tree[tail],
        "rhymerl_tree_verified_per_step": tree["tail_draft_tokens_per_step"],
        "rhymerl_tree_all_steps_mean_accepted": tree["mean_accepted_drafts_per_step"],
        "rhymerl_tree_width_mean": tree["tree_width_mean"],
        "rhymerl_tree_depth_mean": tree["tree_depth_mean"],
        "rhymerl_tail_mean_accepted": linear[tail],
        "rhymerl_tail_draft_per_verify": linear["tail_draft_tokens_per_step"],
        "peer_suffix_tail_mean_accepted": peer[tail] if peer else None,
        "peer_suffix_tail_draft_per_verify": peer["tail_draft_tokens_per_step"] if peer else None,
        "rhymerl_tree_vs_peer_tail_mean_accepted": tree[tail] / peer[tail] if peer and peer[tail] else None,
        "tree_speedup": speedup,
    }


def run_trees_only(name: str, traces: list[R.Trace], peer) -> dict:
    """The tree figures of one trace set, without the other rows (--only-trees)."""
    stop = R.stop_token(traces)
    rows = []
    for config, make in configs(peer, only_trees=True).items():
        rows.append({**R.replay(traces, make, stop, config), "backend": backend(config)})
        print(f"  {name} {config}: tail {rows[-1]['tail_mean_accepted_drafts_per_step']:.3f} accepted / "
              f"{rows[-1]['tail_draft_tokens_per_step']:.2f} verified", file=sys.stderr, flush=True)
    by_name = {r["config"]: r for r in rows}
    peer_row = by_name.get(PEER)
    figures = tree_figures(traces, stop, by_name)
    linear = {str(b): {"peer": R.modeled_speedup(b, peer_row["draft_tokens_per_step"],
                                                 peer_row["mean_accepted_drafts_per_step"]) if peer_row else None}
              for b in BATCH_SIZES}
    return {"name": name, "num_traces": len(traces), **figures,
            "modeled_speedup": {b: {**linear[b], **figures["tree_speedup"][b]} for b in linear}, "rows": rows}


def run_trace_set(name: str, traces: list[R.Trace], peer) -> dict:
    """Every config replayed on one trace set, the modeled speedups, and its summary."""
    stop = R.stop_token(traces)
    rows, drafts = [], {}
    for config, make in configs(peer).items():
        drafts[config] = []
        rows.append({**R.replay(traces, make, stop, config, drafts_log=drafts[config]), "backend": backend(config)})
        print(f"  {name} {config}: {rows[-1]['mean_accepted_drafts_per_step']:.3f} accepted / "
              f"{rows[-1]['draft_tokens_per_step']:.2f} drafted per verify", file=sys.stderr, flush=True)
    truth = {f"{t.prompt_id}/{t.epoch}/{t.sample_index}": t.token_ids for t in traces}
    for config, longest in ((ORACLE, False), (ORACLE_LONGEST, True)):  # the ceilings of our sources
        rows.append({**R.replay(traces, lambda longest=longest: OracleDrafter(truth, DrafterConfig(), 16, longest),
                                stop, config), "backend": "oracle"})
    by_name = {r["config"]: r for r in rows}
    ours, theirs = by_name[RHYMERL], by_name.get(PEER)
    ceiling, ceiling_longest = by_name[ORACLE], by_name[ORACLE_LONGEST]
    speedup = {}
    for batch in BATCH_SIZES:  # rhymerl drafts for this batch size; the peer does not adapt
        row = R.replay(traces, _ours(cost_model=CostModel()), stop, f"{RHYMERL}@{batch}", num_seqs=batch)
        speedup[str(batch)] = {
            "rhymerl": R.modeled_speedup(batch, row["draft_tokens_per_step"], row["mean_accepted_drafts_per_step"]),
            "peer": R.modeled_speedup(batch, theirs["draft_tokens_per_step"],
                                      theirs["mean_accepted_drafts_per_step"]) if theirs else None,
            "rhymerl_accepted_per_verify": row["mean_accepted_drafts_per_step"],
            "rhymerl_draft_per_verify": row["draft_tokens_per_step"],
        }
    trees = tree_figures(traces, stop, by_name)
    floor = R.replay(traces, R.CrossingFloor, stop, FLOOR)
    for batch, figures in trees.pop("tree_speedup").items():
        speedup[batch].update(figures)
    peer_pp = by_name.get(PEER_PER_PROMPT)
    python = by_name[RHYMERL_PYTHON]
    same = [a == b for x, y in zip(drafts[RHYMERL], drafts[RHYMERL_PYTHON]) for a, b in zip(x, y)]
    return {
        "name": name,
        "num_traces": len(traces),
        "num_prompts": len({t.prompt_id for t in traces}),
        "num_epochs": len({t.epoch for t in traces}),
        "mean_response_tokens": float(np.mean([len(t.token_ids) for t in traces])),
        "rhymerl_mean_accepted": ours["mean_accepted_drafts_per_step"],
        "rhymerl_draft_per_verify": ours["draft_tokens_per_step"],
        "peer_suffix_mean_accepted": theirs["mean_accepted_drafts_per_step"] if theirs else None,
        "peer_suffix_draft_per_verify": theirs["draft_tokens_per_step"] if theirs else None,
        "peer_suffix_per_prompt_mean_accepted": peer_pp["mean_accepted_drafts_per_step"] if peer_pp else None,
        "rhymerl_vs_peer_mean_accepted": (ours["mean_accepted_drafts_per_step"]
                                          / theirs["mean_accepted_drafts_per_step"]) if theirs else None,
        "modeled_speedup": speedup,
        # Every drafted token accepted: the most a linear drafter reading our sources could
        # accept per verify (any context >= min_match_len; only the longest continued one).
        "oracle_mean_accepted": ceiling["mean_accepted_drafts_per_step"],
        "oracle_longest_context_mean_accepted": ceiling_longest["mean_accepted_drafts_per_step"],
        "oracle_vs_peer_mean_accepted": (ceiling["mean_accepted_drafts_per_step"]
                                         / theirs["mean_accepted_drafts_per_step"]) if theirs else None,
        "oracle_longest_context_vs_peer_mean_accepted": (ceiling_longest["mean_accepted_drafts_per_step"]
                                                         / theirs["mean_accepted_drafts_per_step"]) if theirs else None,
        "drafting_us_p50": ours["propose_us_p50"],
        "drafting_us_p99": ours["propose_us_p99"],
        # issue 24: the drafter's host time per engine step, side by side in this one run
        "drafter_step_us": {"compiled": ours["drafter_step_us"], "python": python["drafter_step_us"],
                            "peer": theirs["drafter_step_us"] if theirs else None,
                            # the calls and one empty crossing each, no drafting (CrossingFloor)
                            FLOOR: floor["drafter_step_us"]},
        "compiled_vs_python_identical_drafts": (sum(same) / len(same)) if same else None,
        "compiled_vs_python_num_drafts": len(same),
        "compiled_vs_python_accepted": (ours["mean_accepted_drafts_per_step"]
                                        / max(1e-12, python["mean_accepted_drafts_per_step"])),
        "memory_tokens_per_prompt_max": ours["memory_tokens_max"],
        "global_tokens_max": ours["global_tokens_max"],
        **trees,
        "rows": rows,
    }


def _legacy_keys(main: dict) -> dict:
    """The keys drafter.json had before trace sets (first trace set), kept for readers."""
    by_name = {r["config"]: r for r in main["rows"]}
    ngram = max((by_name[f"ngram/{k}"] for k in (4, 8, 16)), key=lambda r: r["mean_accepted_drafts_per_step"])
    ours = by_name[RHYMERL]
    return {
        "ngram_mean_accepted": ngram["mean_accepted_drafts_per_step"],
        "ngram_best_config": ngram["config"],
        "rhymerl_mean_accepted": ours["mean_accepted_drafts_per_step"],
        "rhymerl_best_config": RHYMERL,
        "rhymerl_mean_accepted_fixed": {"16": by_name["all/16"]["mean_accepted_drafts_per_step"]},
        "rhymerl_mean_accepted_adaptive": ours["mean_accepted_drafts_per_step"],
        "rhymerl_vs_ngram_mean_accepted": ours["mean_accepted_drafts_per_step"]
        / max(1e-12, ngram["mean_accepted_drafts_per_step"]),
        "drafting_us_p50": ours["propose_us_p50"],
        "drafting_us_p99": ours["propose_us_p99"],
        "drafting_config": RHYMERL,
        "index_update_us_p50": ours["add_us_p50"],
        "index_update_us_p99": ours["add_us_p99"],
        "traces": main["name"],
        "num_traces": main["num_traces"],
        "num_prompts": main["num_prompts"],
        "num_epochs": main["num_epochs"],
        "mean_response_tokens": main["mean_response_tokens"],
        "rows": main["rows"],
    }


COLUMNS = [  # (header, result key, format)
    ("config", "config", "{}"),
    ("backend", "backend", "{}"),
    ("accepted/verify", "mean_accepted_drafts_per_step", "{:.3f}"),
    ("drafted/verify", "draft_tokens_per_step", "{:.2f}"),
    ("acc rate", "acceptance_rate", "{:.2f}"),
    ("propose p50 µs", "propose_us_p50", "{:.1f}"),
    ("propose p99 µs", "propose_us_p99", "{:.1f}"),
    ("add p99 µs", "add_us_p99", "{:.1f}"),
    ("mem tok/prompt max", "memory_tokens_max", "{:.0f}"),
    ("global tok max", "global_tokens_max", "{:.0f}"),
    ("speedup (replay batch)", "cost_model_speedup", "{:.2f}"),
]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--traces", nargs="*", default=None, help="trace files; default: synthetic")
    parser.add_argument("--out", default="benchmarks/results", help="where drafter.md/.json go")
    parser.add_argument("--seed", type=int, default=0, help="synthetic traces' seed")
    parser.add_argument("--only-trees", action="store_true",
                        help="only the draft-tree figures (the peer, rhymerl, rhymerl/tree): drafter_trees.{md,json}")
    args = parser.parse_args(argv)
    R.check_trace_files(parser, args.traces)
    try:
        peer, peer_note = load_peer(), "built from the arctic-inference sdist"
    except PeerUnavailable as exc:
        peer, peer_note = None, str(exc)
        print(f"peer left out: {exc}", file=sys.stderr)
    sets = [(path, R.load_traces(path)) for path in args.traces or []]
    if not sets:
        sets = [(f"synthetic(seed={args.seed})", R.synthetic_traces(seed=args.seed))]
    started, load_before = time.time(), os.getloadavg()[0]
    command = "python -m benchmarks.drafter_bench" + (" --traces " + " ".join(args.traces) if args.traces else "")
    if args.only_trees:
        return _trees_only(sets, peer, peer_note, command + " --only-trees", started, load_before, Path(args.out))
    trace_sets = [{**run_trace_set(name, traces, peer), "command": command} for name, traces in sets]
    summary = {
        **_legacy_keys(trace_sets[0]),
        "drafter_step_us": trace_sets[0]["drafter_step_us"],  # the first trace set's; each set has its own
        "trace_sets": trace_sets,
        "peer": {"name": "vLLM method=suffix (arctic-inference SuffixDecodingCache)", "available": peer is not None,
                 "note": peer_note, "max_tree_depth": MAX_TREE_DEPTH, "max_cached_requests": MAX_CACHED_REQUESTS,
                 "max_spec_factor": 1.0, "min_token_prob": 0.1, "num_speculative_tokens": 16},
        "cpu": cpu_name(),
        "device": "CPU, one core (drafting is host-side); speedups are modeled on the engine's H100 cost curve",
        "python": platform.python_version(),
        "git_commit": git_commit("services/rollout/drafter", "benchmarks/drafter_bench.py",
                                 "benchmarks/drafter_replay.py"),
        "command": command,
        "wall_s": time.time() - started,
        "load_average_1min": [load_before, os.getloadavg()[0]],
        "timing_clock": "time.thread_time_ns (CPU time of the replay thread), the drafter's spans net of the "
                        "garbage collector's pauses inside them (with them: drafter_step_us's with_gc)",
        "garbage_collector": R.gc_policy(),
    }
    text = "\n\n".join(_section(s) for s in trace_sets)
    print(text)
    write_results(args.out, "drafter", summary, _markdown(summary, text))
    return summary


def _trees_only(sets, peer, peer_note: str, command: str, started: float, load_before: float, out: Path) -> dict:
    trace_sets = [{**run_trees_only(name, traces, peer), "command": command} for name, traces in sets]
    summary = {
        "trace_sets": trace_sets,
        "peer": {"name": "vLLM method=suffix (arctic-inference SuffixDecodingCache)", "available": peer is not None,
                 "note": peer_note},
        "cpu": cpu_name(),
        "device": "CPU, one core (drafting is host-side); speedups are modeled on the engine's H100 cost curve",
        "python": platform.python_version(),
        "git_commit": git_commit("services/rollout/drafter", "services/rollout/engine/tree.py",
                                 "benchmarks/drafter_bench.py", "benchmarks/drafter_replay.py"),
        "command": command,
        "wall_s": time.time() - started,
        "load_average_1min": [load_before, os.getloadavg()[0]],
    }
    fmt = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
    lines = ["| trace set | tree accepted / verified (tail) | rhymerl linear (tail) | vLLM suffix (tail) | "
             "tree vs peer | tree width / depth (mean) |", "|---|---|---|---|---|---|"]
    speed = ["| trace set | batch | rhymerl/tree accepted / drafted | rhymerl/tree speedup | vLLM suffix speedup |",
             "|---|---|---|---|---|"]
    for s in trace_sets:
        lines.append(f"| {s['name']} | {fmt(s['rhymerl_tree_mean_accepted'])} / "
                     f"{fmt(s['rhymerl_tree_verified_per_step'])} | {fmt(s['rhymerl_tail_mean_accepted'])} / "
                     f"{fmt(s['rhymerl_tail_draft_per_verify'])} | {fmt(s['peer_suffix_tail_mean_accepted'])} / "
                     f"{fmt(s['peer_suffix_tail_draft_per_verify'])} | "
                     f"{fmt(s['rhymerl_tree_vs_peer_tail_mean_accepted'])}x | "
                     f"{fmt(s['rhymerl_tree_width_mean'])} / {fmt(s['rhymerl_tree_depth_mean'])} |")
        for b, v in s["modeled_speedup"].items():
            speed.append(f"| {s['name']} | {b} | {fmt(v['rhymerl_tree_accepted_per_verify'])} / "
                         f"{fmt(v['rhymerl_tree_draft_per_verify'])} | {fmt(v['rhymerl_tree'])} | {fmt(v['peer'])} |")
    timing = ["| trace set | tree propose µs/seq p50 / p99 (compiled) | (Python reference) |", "|---|---|---|"]
    for s in trace_sets:
        t = s["rhymerl_tree_tail_propose_us"]
        py = t["python"] or {"propose_p50": None, "propose_p99": None}
        timing.append(f"| {s['name']} | {fmt(t['compiled']['propose_p50'])} / {fmt(t['compiled']['propose_p99'])} | "
                      f"{fmt(py['propose_p50'])} / {fmt(py['propose_p99'])} |")
    text = ("\n".join(lines) + "\n\nModeled rollout speedup at a steady batch (engine cost curve):\n\n" + "\n".join(speed)
            + "\n\nThe drafter's propose per sequence and step on the tail (thread CPU time, steps with at most "
            f"{R.TAIL_BATCH} sequences):\n\n" + "\n".join(timing))
    print(text)
    write_results(out, "drafter_trees", summary,
        f"# Draft trees on the replay's tail\n\nCommand: `{command}` (OMP_NUM_THREADS=1), commit "
        f"{summary['git_commit']}, CPU: {summary['cpu']}, wall {summary['wall_s']:.0f} s. Peer: "
        f"{summary['peer']['name']}, {peer_note}.\n\nThe lockstep replay of drafter.md; `tail` = the steps "
        f"with at most {R.TAIL_BATCH} sequences left in their epoch; accepted / verified = accepted and verified "
        f"draft tokens per sequence and verify step there (a tree's nodes are all verified; its accepted tokens "
        f"are the path the engine's verifier follows). rhymerl/tree = the compiled drafter with "
        f"DrafterConfig(tree=True) and the cost threshold at the replay's batch; at batch > 16 it drafts "
        f"linearly. rhymerl/tree-python = the same trees from the Python reference.\n\n{text}\n")
    return summary


def _section(s: dict) -> str:
    rows = [{"batch": b, **v} for b, v in s["modeled_speedup"].items()]
    fmt = lambda x: "n/a" if x is None else f"{x:.2f}"  # noqa: E731
    speed = "\n".join(["| batch | rhymerl accepted/verify | rhymerl drafted/verify | rhymerl speedup | "
                       "vLLM suffix speedup |", "|---|---|---|---|---|"]
                      + [f"| {r['batch']} | {r['rhymerl_accepted_per_verify']:.3f} | {r['rhymerl_draft_per_verify']:.2f} "
                         f"| {fmt(r['rhymerl'])} | {fmt(r['peer'])} |" for r in rows])
    ratio = s["rhymerl_vs_peer_mean_accepted"]
    steps = "\n".join(["| backend | propose p50 | propose p99 | commit p50 | commit p99 | step ms (>= 100 seqs) "
                       "| one-seq step p99 |", "|---|---|---|---|---|---|---|"]
                      + [f"| {k} | {fmt(v['propose_p50'])} | {fmt(v['propose_p99'])} | {fmt(v['commit_p50'])} "
                         f"| {fmt(v['commit_p99'])} | {fmt(v['step_ms_100plus'])} | {fmt(v['one_seq_p99'])} |"
                         for k, v in s["drafter_step_us"].items() if v])
    same = s["compiled_vs_python_identical_drafts"]
    return (f"### {s['name']}\n\n{s['num_prompts']} prompts x {s['num_epochs']} epochs, {s['num_traces']} "
            f"responses, mean {s['mean_response_tokens']:.0f} tokens. rhymerl vs vLLM suffix (global tree), "
            f"accepted per verify: **{fmt(ratio)}x**; the oracle ceiling of our sources vs the peer: "
            f"{fmt(s['oracle_vs_peer_mean_accepted'])}x (any context), "
            f"{fmt(s['oracle_longest_context_vs_peer_mean_accepted'])}x (longest context only).\n\n{markdown_table(s['rows'], COLUMNS)}\n\n"
            f"Modeled rollout speedup at a steady batch (engine cost curve):\n\n{speed}\n\n"
            f"The drafter's host time per engine step (thread CPU time net of the garbage collector's pauses "
            f"inside the spans, `with_gc` in the JSON has them; µs per sequence per step over the "
            f"steps with >= 16 sequences, the whole step's ms with >= 100): the compiled core and the Python "
            f"reference (identical drafts: {fmt(100 * same if same is not None else None)}% of "
            f"{s['compiled_vs_python_num_drafts']}) beside vLLM's suffix tree, in this one run; `floor` is the "
            f"same replay's calls with one empty crossing into the core each and no drafting (what the clock, "
            f"the calls and a ctypes crossing cost here, below any drafter):\n\n{steps}")


def _markdown(summary: dict, text: str) -> str:
    return f"""# Drafter benchmark

Command: `{summary['command']}` (OMP_NUM_THREADS=1), commit {summary['git_commit']},
CPU: {summary['cpu']}, Python {summary['python']}, wall {summary['wall_s']:.0f} s,
1-min load average {summary['load_average_1min'][0]:.1f} -> {summary['load_average_1min'][1]:.1f}
on {os.cpu_count()} cores shared with other work (times are thread CPU time; a loaded
machine still inflates them). Peer: {summary['peer']['name']}, {summary['peer']['note']}.
Garbage collector: {summary['garbage_collector']['policy']}.

Replay (one function for every drafter, `benchmarks/drafter_replay.py`): every epoch in
order, all samples of an epoch advance together one verify step at a time (siblings see
only committed tokens), every running request's committed tokens go into rhymerl's
global index as they come (as the peer's global tree takes them) and each finished
response is handed to it as on a worker (recognised, not indexed twice); a draft token is accepted when it equals the trace's next token. `accepted/verify`
= accepted draft tokens per verify step (the bonus token excluded), `drafted/verify` =
draft tokens per verify step, at most 16. `rhymerl` = history + siblings + prompt +
global index, draft length from the engine's H100 cost curve at the replay's batch;
`/16` rows draft whenever a continuation exists. `oracle/*` rows know the trace: they
draft the longest run of the true next tokens that a source saw after the request's
context (any suffix >= min_match_len, or the longest continued one only), so every
token is accepted: the ceiling of chain drafting from these sources
(`benchmarks/drafter_oracle.py`). `vllm-suffix` = vLLM's method="suffix"
defaults (max_tree_depth {MAX_TREE_DEPTH}, max_cached_requests {MAX_CACHED_REQUESTS}, max_spec_factor
1.0, min_token_prob 0.1, num_speculative_tokens 16), one SuffixDecodingCache driven as
vLLM's proposer does; `/per-prompt` = one cache per prompt. `propose`/`add` = host CPU
time per sequence per step (one propose call over the batch, divided by its size); `mem`
= indexed tokens of one prompt's index at a step's end; `global tok` = the global index.
Modeled speedup at batch B: (T(B)/B) / (T(B(1+d))/(B(1+a))) with d, a = drafted and
accepted per verify, T = services/rollout/engine/cost_model.py's 0.5B H100 curve.

{text}
"""


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    R.worker_gc()
    main()
