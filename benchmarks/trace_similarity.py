"""How much do a prompt's responses rhyme across RL epochs? Measured on recorded traces.

    python -m benchmarks.trace_similarity benchmarks/data/tiny_grpo.npz [more.npz ...]

For each epoch e after the first, and each prompt also sampled in the epoch before:
- hit share: the share of each response's tokens that a longest-suffix match against the
  same prompt's epoch e-1 responses predicts (at each position, the longest suffix of the
  response so far found in an e-1 response, and the token that most often followed it;
  `SuffixMatchPredictor` in reasoning_task.py). It bounds what a history drafter can get
  accepted per token, with no siblings and no shorter-context fallbacks.
- the same token hit share when the match may also use this epoch's earlier siblings
  (responses to the same prompt with a smaller sample index), as a grouped drafter can.
- length correlation: Pearson and Spearman between the prompts' mean response lengths in
  e-1 and in e (is a prompt that was long last epoch long again?).

Prints a table and writes benchmarks/results/traces.md and traces.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.policy import load_example
from benchmarks.traces import TraceRecord, read_traces

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation; NaN when either side is constant or has fewer than 2 values."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing their mean rank."""
    x = np.asarray(x)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x), dtype=np.float64)
    r[order] = np.arange(1, len(x) + 1)
    for value in np.unique(x):
        tied = x == value
        r[tied] = r[tied].mean()
    return r


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    return pearson(ranks(x), ranks(y))


def epoch_similarity(previous: list[TraceRecord], current: list[TraceRecord]) -> dict:
    """Similarity of one epoch's responses (`current`) to the epoch before (`previous`)."""
    predictor_cls = load_example("reasoning_task").SuffixMatchPredictor
    by_prompt: dict[str, list[TraceRecord]] = defaultdict(list)
    for r in previous:
        by_prompt[r.prompt_id].append(r)
    current_tokens: dict[str, list[np.ndarray]] = defaultdict(list)
    for r in sorted(current, key=lambda r: r.sample_index):
        current_tokens[r.prompt_id].append(r.token_ids)
    num_tokens, num_hits, num_sibling_hits, shares = 0, 0, 0, []
    current_lengths: dict[str, list[int]] = defaultdict(list)
    for r in sorted(current, key=lambda r: (r.prompt_id, r.sample_index)):
        if r.prompt_id not in by_prompt:
            continue
        history = [p.token_ids.tolist() for p in by_prompt[r.prompt_id]]
        # Siblings: this epoch's responses to the same prompt with a smaller sample index.
        siblings = [t.tolist() for t in current_tokens[r.prompt_id][: r.sample_index]]
        response = r.token_ids.tolist()
        hits = predictor_cls(history).count_hits(response)
        num_sibling_hits += predictor_cls(history + siblings).count_hits(response)
        num_tokens += len(response)
        num_hits += hits
        shares.append(hits / max(1, len(response)))
        current_lengths[r.prompt_id].append(len(response))
    prompts = sorted(current_lengths)
    before = np.array([np.mean([len(p.token_ids) for p in by_prompt[pid]]) for pid in prompts])
    after = np.array([np.mean(current_lengths[pid]) for pid in prompts])
    return {
        "num_prompts": len(prompts),
        "num_responses": len(shares),
        "num_tokens": num_tokens,
        "token_hit_share": num_hits / max(1, num_tokens),
        "mean_response_hit_share": float(np.mean(shares)) if shares else float("nan"),
        "token_hit_share_with_siblings": num_sibling_hits / max(1, num_tokens),
        "mean_length": float(after.mean()) if len(after) else float("nan"),
        "length_pearson": pearson(before, after),
        "length_spearman": spearman(before, after),
    }


def trace_similarity(records: list[TraceRecord]) -> list[dict]:
    """One row per epoch after the first: `epoch_similarity` against the epoch before."""
    by_epoch: dict[int, list[TraceRecord]] = defaultdict(list)
    for r in records:
        by_epoch[r.epoch].append(r)
    epochs = sorted(by_epoch)
    return [{"epoch": e, **epoch_similarity(by_epoch[prev], by_epoch[e])} for prev, e in zip(epochs, epochs[1:])]


def _commit() -> str:
    """HEAD's short hash, "-dirty" when the work tree has changes; "uncommitted" without a commit."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"
    return head.stdout.strip() + ("-dirty" if status.stdout.strip() else "")


_COLUMNS = (
    ("epoch", "epoch", "{}"),
    ("prompts", "num_prompts", "{}"),
    ("responses", "num_responses", "{}"),
    ("mean len", "mean_length", "{:.1f}"),
    ("token hit share", "token_hit_share", "{:.3f}"),
    ("mean response hit share", "mean_response_hit_share", "{:.3f}"),
    ("token hit share +siblings", "token_hit_share_with_siblings", "{:.3f}"),
    ("len Pearson", "length_pearson", "{:.3f}"),
    ("len Spearman", "length_spearman", "{:.3f}"),
)


def format_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(name for name, _, _ in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for _, key, fmt in _COLUMNS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="trace files (.npz, benchmarks/traces.py format)")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR), help="where traces.md/.json go")
    args = parser.parse_args(argv)

    command = "python -m benchmarks.trace_similarity " + " ".join(sys.argv[1:] if argv is None else argv)
    results = {"command": command, "commit": _commit(), "traces": {}}
    md = [
        "# Cross-epoch similarity of recorded rollouts",
        "",
        f"Command: `{command}` (commit {results['commit']}).",
        "",
        "Hit share: tokens a longest-suffix match against the same prompt's previous-epoch",
        "responses predicts, per token (token) or averaged per response; +siblings: the match",
        "may also use the same epoch's responses with a smaller sample index. Length",
        "correlation: prompts' mean response lengths, previous epoch vs this one.",
        "Where each trace file comes from: benchmarks/data/README.md.",
    ]
    for path in args.paths:
        rows = trace_similarity(read_traces(path))
        results["traces"][str(path)] = rows
        table = format_table(rows)
        print(f"{path}\n{table}\n")
        md += ["", f"## {path}", "", table]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "traces.md").write_text("\n".join(md) + "\n")
    (out_dir / "traces.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
