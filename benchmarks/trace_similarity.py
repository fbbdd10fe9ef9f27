"""How much do a prompt's responses rhyme across RL epochs? Measured on recorded traces.

    python -m benchmarks.trace_similarity benchmarks/data/tiny_grpo_service.npz [more.npz ...]

For each epoch e after the first, and each prompt also sampled in the epoch before:
- token match share: the share of each response's tokens that a longest-suffix match against the
  same prompt's epoch e-1 responses predicts (at each position, the longest suffix of the
  response so far found in an e-1 response, and the token that most often followed it;
  `SuffixMatchPredictor` in reasoning_task.py). It bounds what a history drafter can get
  accepted per token, with no siblings and no shorter-context fallbacks.
- the same token match share when the match may also use this epoch's earlier siblings
  (responses to the same prompt with a smaller sample index), as a grouped drafter can.
- length correlation: Pearson and Spearman between the prompts' mean response lengths in
  e-1 and in e (is a prompt that was long last epoch long again?).
Over all responses of a file: max_over_median_length, the longest response's length
over the median response length (how heavy the length tail is).

Prints a table and writes benchmarks/results/similarity.md and similarity.json. The JSON
holds the first file's figures at the top level ("epochs": one row per epoch e > 0 with
"epoch", "token_match_share", "length_spearman", ...; "max_over_median_length";
"command"; "commit"; "device"), and every file's under "files".
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.provenance import git_commit
from benchmarks.report import markdown_table, write_results
from benchmarks.tiny_llm.examples import load_example
from services.common.traces import TraceRecord, read_traces

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
        "token_match_share": num_hits / max(1, num_tokens),
        "mean_response_match_share": float(np.mean(shares)) if shares else float("nan"),
        "token_match_share_with_siblings": num_sibling_hits / max(1, num_tokens),
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
    return [{"epoch": e, **epoch_similarity(by_epoch[prev], by_epoch[e])} for prev, e in itertools.pairwise(epochs)]


def length_stats(records: list[TraceRecord]) -> dict:
    """Response lengths over all records: median, max and max / median (the tail)."""
    lengths = np.array([len(r.token_ids) for r in records], dtype=np.float64)
    if not len(lengths):
        return {"num_responses": 0, "median_length": float("nan"), "max_length": 0,
                "num_at_max_length": 0, "max_over_median_length": float("nan")}
    median = float(np.median(lengths))
    return {
        "num_responses": len(lengths),
        "median_length": median,
        "max_length": int(lengths.max()),
        # responses as long as the longest: many means a max_tokens cap cut the tail
        "num_at_max_length": int((lengths == lengths.max()).sum()),
        "max_over_median_length": float(lengths.max() / median) if median > 0 else float("nan"),
    }


_COLUMNS = (
    ("epoch", "epoch", "{}"),
    ("prompts", "num_prompts", "{}"),
    ("responses", "num_responses", "{}"),
    ("mean len", "mean_length", "{:.1f}"),
    ("token match share", "token_match_share", "{:.3f}"),
    ("mean response match share", "mean_response_match_share", "{:.3f}"),
    ("token match share +siblings", "token_match_share_with_siblings", "{:.3f}"),
    ("len Pearson", "length_pearson", "{:.3f}"),
    ("len Spearman", "length_spearman", "{:.3f}"),
)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="trace files (.npz, services/common/traces.py format)")
    parser.add_argument("--out-dir", default=str(RESULTS_DIR), help="where similarity.md/.json go")
    args = parser.parse_args(argv)

    command = "python -m benchmarks.trace_similarity " + " ".join(sys.argv[1:] if argv is None else argv)
    files = {}
    md_sections = []
    for path in args.paths:
        records = read_traces(path)
        rows = trace_similarity(records)
        lengths = length_stats(records)
        files[str(path)] = {"epochs": rows, **lengths}
        table = markdown_table(rows, _COLUMNS)
        tail = (f"Response lengths over all epochs: median {lengths['median_length']:.1f}, "
                f"max {lengths['max_length']} ({lengths['num_at_max_length']} responses that long), "
                f"max / median "
                f"{lengths['max_over_median_length']:.2f}.")
        print(f"{path}\n{table}\n{tail}\n")
        md_sections += ["", f"## {path}", "", table, "", tail]
    first = files[str(args.paths[0])]
    results = {
        "command": command,
        "commit": git_commit(),
        "device": "CPU (host-side analysis of recorded traces; where each file was sampled: "
                  "benchmarks/data/README.md)",
        "traces": str(args.paths[0]),
        "epochs": first["epochs"],
        "max_over_median_length": first["max_over_median_length"],
        "median_length": first["median_length"],
        "max_length": first["max_length"],
        "num_at_max_length": first["num_at_max_length"],
        "files": files,
    }
    md = [
        "# Cross-epoch similarity of recorded rollouts",
        "",
        f"Command: `{command}` (commit {results['commit']}).",
        "",
        "Token match share: tokens a longest-suffix match against the same prompt's",
        "previous-epoch responses predicts, per token (token) or averaged per response;",
        "+siblings: the match may also use the same epoch's responses with a smaller sample",
        "index. Length correlation: prompts' mean response lengths, previous epoch vs this",
        "one. Max / median: the longest response over the median response, all epochs.",
        "Where each trace file comes from: benchmarks/data/README.md.",
        *md_sections,
    ]
    write_results(args.out_dir, "similarity", results, "\n".join(md) + "\n")
    return results


if __name__ == "__main__":
    main()
