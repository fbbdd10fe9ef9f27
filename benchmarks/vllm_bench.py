"""vLLM as the rollout engine, side by side on the CPU: vLLM without speculation, with its
n-gram and suffix methods and with rhymerl's history proposer, and rhymerl's own engine,
on the same prompts, seeds and history.

    python -m benchmarks.vllm_bench [--prompts 8 --samples 4 --max-tokens 256]

Workload: the tiny SFT policy (models/tiny, trained on first use as `make run` does) on the
last recorded epoch's prompts of benchmarks/data/tiny_grpo_cpu.npz, T=1, one seed per
sample; history = the recorded earlier epochs' responses, loaded into rhymerl's drafter
(both engines). Each row runs in its own process (one vLLM engine per process).
accepted_per_verify: accepted draft tokens per verify step that had a draft (vLLM's own
spec-decode counts for vLLM rows; the engine's counters for rhymerl's engine).
identical_greedy: the row's greedy tokens equal its engine's run without speculation.
Writes benchmarks/results/vllm.md and vllm.json. The CUDA vLLM backend is not measured:
its wheel cannot travel to the lent GPU machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table
from services.rollout.vllm_engine.builder import intel_openmp_env

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = [("vllm", "none"), ("vllm", "ngram"), ("vllm", "suffix"), ("vllm", "rhymerl"),
        ("rhymerl", "none"), ("rhymerl", "rhymerl")]


def workload(args, temperature: float):
    from benchmarks.engine_grpo import TRACES, grpo_requests
    from services.common.traces import read_traces
    from services.rollout.loader import read_config

    records = read_traces(TRACES)
    eos = tuple(read_config(args.model_dir).eos_token_ids)
    last = max(r.epoch for r in records)
    history: dict[str, list[list[int]]] = {}
    for r in records:
        if r.epoch < last:
            history.setdefault(r.prompt_id, []).append([int(t) for t in r.token_ids])
    return grpo_requests(records, args.prompts, args.samples, temperature, args.max_tokens, eos), history


def run_row(engine_name: str, proposer: str, args) -> dict:
    """One row, in this process: greedy (for identical_greedy), then the timed T=1 run."""
    from services.rollout.engine_choice import build_engine
    from services.rollout.settings import WorkerSettings
    from services.rollout.engine import run_to_completion

    settings = WorkerSettings(model_path=args.model_dir, engine=engine_name, device="cpu", dtype="float32",
                              max_num_seqs=256, speculative=proposer != "none", max_draft_len=args.draft_len,
                              num_kv_blocks=4096 if engine_name == "rhymerl" else 0)  # vLLM sizes its own
    if engine_name == "vllm":
        from services.rollout.vllm_engine.builder import build_vllm_engine

        if proposer == "suffix":
            from benchmarks.peers.suffix_decoding import load_peer

            load_peer()  # puts the built peer on sys.path, where vLLM's suffix method imports it

        engine = build_vllm_engine(settings, None if proposer == "none" else proposer)
    else:
        engine = build_engine(settings, "bench")
    greedy, history = workload(args, 0.0)
    sampled, _ = workload(args, 1.0)
    if getattr(engine, "drafter", None) is not None and proposer == "rhymerl":
        for prompt_id, responses in history.items():
            engine.drafter.load_history(prompt_id, responses)
    run_to_completion(engine, greedy[:2])  # warm-up
    greedy_out = run_to_completion(engine, greedy)
    stats = getattr(engine, "stats", None)
    before = (stats.num_drafts, stats.num_accepted_tokens) if stats else (0, 0)
    start = time.perf_counter()
    out = run_to_completion(engine, sampled)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in out.values())
    # rhymerl's per-chunk counters: verify steps whose draft was not empty
    own = (sum(o.num_verify_steps for o in out.values()), sum(o.num_accepted_tokens for o in out.values()))
    # vLLM's own counts (every method alike): one "draft" per request and step it scheduled speculation for
    verifies, accepted = (stats.num_drafts - before[0], stats.num_accepted_tokens - before[1]) if stats else own
    return dict(engine=engine_name, proposer=proposer, tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
                accepted_per_verify=accepted / verifies if verifies else None, verifies=verifies, accepted=accepted,
                accepted_per_nonempty_draft=own[1] / own[0] if own[0] else None,
                greedy={k: o.token_ids for k, o in greedy_out.items()})


def fmt_load(load) -> str:
    return "/".join(f"{x:.1f}" for x in load)


def unavailable(engine: str, proposer: str) -> str | None:
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make install-vllm)"
    if proposer == "suffix":
        from benchmarks.peers.suffix_decoding import PeerUnavailable, load_peer

        try:
            load_peer()  # vLLM's suffix method imports arctic_inference.suffix_decoding
        except PeerUnavailable as exc:
            return str(exc)
    return None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-dir", default="models/tiny", help="the trained tiny policy (trained if missing)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--draft-len", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--row", help=argparse.SUPPRESS)  # engine:proposer, run in a child process
    parser.add_argument("--row-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        Path(args.row_json).write_text(json.dumps(run_row(*args.row.split(":"), args)))
        return {}
    from benchmarks.tiny_llm.checkpoint import ensure_model

    ensure_model(args.model_dir)
    command = "python -m benchmarks.vllm_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    load_before = os.getloadavg()  # the machine is shared: a loaded run shows here
    rows = []
    for engine, proposer in ROWS:
        reason = unavailable(engine, proposer)
        if reason is None:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                child = [sys.executable, "-m", "benchmarks.vllm_bench", "--row", f"{engine}:{proposer}",
                         "--row-json", f.name, "--model-dir", args.model_dir, "--prompts", str(args.prompts),
                         "--samples", str(args.samples), "--max-tokens", str(args.max_tokens),
                         "--draft-len", str(args.draft_len)]
                done = subprocess.run(child, capture_output=True, text=True, env=intel_openmp_env(os.environ))
                if done.returncode == 0:
                    rows.append(json.loads(Path(f.name).read_text()))
                    continue
                reason = "failed: " + (done.stderr.strip().splitlines() or ["?"])[-1]
        rows.append(dict(engine=engine, proposer=proposer, tokens=None, wall_s=None, tokens_per_s=None,
                         accepted_per_verify=None, verifies=None, accepted=None, accepted_per_nonempty_draft=None,
                         greedy=None, not_measured=reason))
    plain = {r["engine"]: r["greedy"] for r in rows if r["proposer"] == "none"}
    for r in rows:
        base = plain.get(r["engine"])
        r["identical_greedy"] = None if r["greedy"] is None or base is None else r["greedy"] == base
        r["command"] = command
    vllm_version = None
    if importlib.util.find_spec("vllm") is not None:
        import vllm
        vllm_version = vllm.__version__
    result = dict(vllm_version=vllm_version, device=f"cpu ({cpu_name()})",
                  rows=[{k: v for k, v in r.items() if k != "greedy"} for r in rows], command=command,
                  commit=git_commit(), workload=f"{args.prompts} prompts x {args.samples} samples, T=1, max "
                  f"{args.max_tokens} tokens, draft length {args.draft_len}, tiny SFT policy, recorded history",
                  load_average_before=load_before, load_average_after=os.getloadavg(),
                  not_measured={"gpu": "vLLM's CUDA wheel cannot travel to the lent GPU machine"})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm.json").write_text(json.dumps(result, indent=2) + "\n")
    shown = [{**r, **{k: "null" if r[k] is None else round(r[k], 2) for k in
                      ("accepted_per_verify", "accepted_per_nonempty_draft", "tokens_per_s", "wall_s")},
              "identical_greedy": "null" if r["identical_greedy"] is None else r["identical_greedy"]}
             for r in result["rows"]]
    table = markdown_table(shown,
                           [("engine", "engine", "{}"), ("proposer", "proposer", "{}"),
                            ("accepted/verify", "accepted_per_verify", "{}"), ("verifies", "verifies", "{}"),
                            ("accepted/non-empty draft", "accepted_per_nonempty_draft", "{}"),
                            ("tokens", "tokens", "{}"), ("tokens/s", "tokens_per_s", "{}"),
                            ("wall s", "wall_s", "{}"), ("identical greedy", "identical_greedy", "{}")])
    notes = "\n".join(f"- {r['engine']} / {r['proposer']}: not measured: {r['not_measured']}"
                      for r in result["rows"] if r.get("not_measured"))
    (out / "vllm.md").write_text(f"# vLLM as the rollout engine (CPU)\n\n{result['workload']}; vLLM "
                                 f"{vllm_version}; {result['device']}; commit {result['commit']}; load average (1, 5, 15 min) "
                                 f"{fmt_load(load_before)} before, {fmt_load(result['load_average_after'])} after.\n\n"
                                 f"    {command}\n\n{table}\n\n{notes}\n\nGPU: not measured ("
                                 f"{result['not_measured']['gpu']}).\n")
    print(table)
    return result


if __name__ == "__main__":
    main()
