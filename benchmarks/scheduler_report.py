"""scheduler_bench's report: the tables, the issue's targets stated from the rows, and the
notes on how to read them (scheduler.md)."""

from __future__ import annotations


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    head = "| " + " | ".join(title for title, _, _ in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join("-" if row.get(key) is None else format(row[key], fmt)
                              for _, key, fmt in columns) + " |" for row in rows]
    return "\n".join([head, rule, *body])


MAIN_COLUMNS = [("workers", "workers", "d"), ("policy", "policy", "s"), ("samples", "samples", "d"),
                ("seeds", "seeds", "d"),
                ("makespan s", "makespan_s", ".1f"), ("vs static", "makespan_s_vs_static", ".3f"),
                ("bubble", "bubble_ratio", ".3f"), ("vs static", "bubble_ratio_vs_static", ".3f"),
                ("tail s", "tail_s", ".1f"), ("vs static", "tail_s_vs_static", ".3f"),
                ("vs oracle", "makespan_vs_oracle", ".3f"), ("migrations", "migrations", ".0f"), ("re-prefill tok", "reprefill_tokens", ".0f"),
                ("sim wall s", "sim_wall_s", ".1f")]
MULTI_COLUMNS = [("policy", "policy", "s"), ("steps", "steps", "d"), ("total s", "makespan_s", ".1f"),
                 ("vs static", "makespan_s_vs_static", ".3f"), ("fleet bubble", "bubble_ratio", ".3f"),
                 ("migrations", "migrations", ".0f"), ("stale-start samples", "stale_start_samples", ".0f"),
                 ("mixed-version samples", "mixed_version_samples", ".0f"), ("seeds", "seeds", "d")]


def targets(rows: list[dict]) -> list[dict]:
    """The issue's targets per (workload, fleet >= 64) where static has >= 40% bubble."""
    out = []
    for r in rows:
        if r["policy"] != "rhymerl" or r["mode"] != "sim" or r["workers"] < 64:
            continue
        same = {x["policy"]: x for x in rows if x["mode"] == "sim" and x["workload"] == r["workload"]
                and x["workers"] == r["workers"]}
        static, oracle = same["static"], same["oracle"]
        out.append({"workload": r["workload"], "workers": r["workers"],
                    "static_bubble": static["bubble_ratio"], "qualifies": static["bubble_ratio"] >= 0.4,
                    "bubble": r["bubble_ratio"], "bubble_met": r["bubble_ratio"] <= 0.05,
                    "makespan_vs_oracle": r["makespan_s"] / oracle["makespan_s"],
                    "makespan_met": r["makespan_s"] <= 1.15 * oracle["makespan_s"],
                    "tail_reduction": 1.0 - r["tail_s"] / static["tail_s"],
                    "tail_met": r["tail_s"] <= 0.25 * static["tail_s"]})
    return out


def render_markdown(summary: dict, acc_table: str) -> str:
    c = summary["config"]
    parts = [
        "# Scheduler: placement policies in the fleet simulator (and live)\n",
        (f"Command: `{summary['command']}` (OMP_NUM_THREADS=1), commit {summary['commit']}, "
         f"{summary['wall_s']:.0f} s wall. Device: {summary['device']}.\n"),
        (f"Simulated batch: {c['samples_per_worker']} samples per worker in groups of n={c['n']}, capacity "
         f"{c['capacity']} sequences per worker, {c['model']} H100 cost curve (weights only: attention time "
         f"not modelled), event quantum {c['quantum']} s; {c['seeds']} seeds averaged up to {c['seeds_up_to']} workers, one "
         "above.\n"),
        "Workloads:\n",
        *[f"- `{name}`: {d['source']}, epoch {d['epoch']} (earlier epochs are history); median "
          f"{d['median_len']} tokens, longest {d['max_len']} ({d['max_over_median']:.1f}x the median), "
          f"{d['share_ge_20x_median']:.2%} of samples >= 20x the median."
          for name, d in summary["workloads"].items()],
        "",
    ]
    for name in summary["workloads"]:
        rows = [r for r in summary["rows"] + summary["sections"].get(name, [])
                if r["workload"] == name and r["mode"] == "sim"]
        parts.append(f"## {name} (sim)\n\n{table(rows, MAIN_COLUMNS)}\n")
    live = [r for r in summary["rows"] if r["mode"] == "live"]
    if live:
        parts.append("## Live (real CPU workers, tiny random model)\n\n" + table(live, LIVE_COLUMNS) + "\n")
    if summary["targets"]:
        parts.append("## Targets (rhymerl, simulated, 64+ workers)\n\n" + table(summary["targets"], TARGET_COLUMNS)
                     + "\n\n" + target_verdict(summary["targets"]) + "\n")
    titles = summary["section_titles"]
    for name, rows in summary["sections"].items():
        if name in summary["workloads"]:
            continue  # drawn with the workloads above
        columns = MULTI_COLUMNS if name == "cross_step" else MAIN_COLUMNS
        parts.append(f"## {titles.get(name, name)}\n\n{table(rows, columns)}\n")
    parts.append(f"## Length model accuracy (rhymerl's predictions at step start)\n\n{acc_table}\n")
    parts.append(NOTES)
    return "\n".join(parts)


def target_verdict(rows: list[dict]) -> str:
    """The issue's targets, stated from the measured rows (nothing hand-written)."""
    lines = []
    for workload in sorted({r["workload"] for r in rows}):
        mine = [r for r in rows if r["workload"] == workload]
        qualifying = [r for r in mine if r["qualifies"]]
        fleets = ", ".join(str(r["workers"]) for r in qualifying) or "none"
        lines.append(f"- `{workload}`: static has >= 40% bubble at {fleets} workers.")
        for key, what in (("bubble_met", "bubble <= 5%"), ("makespan_met", "makespan <= 1.15x oracle"),
                          ("tail_met", "tail >= 75% below static")):
            met = [r for r in mine if r[key]]
            lines.append(f"  - {what}: met at {len(met)} of {len(mine)} fleet sizes "
                         f"({', '.join(str(r['workers']) for r in met) or 'none'}).")
    return "\n".join(lines)


LIVE_COLUMNS = [("workers", "workers", "d"), ("policy", "policy", "s"), ("workload", "workload", "s"),
                ("samples", "samples", "d"), ("median tok", "median_len", "d"), ("max tok", "max_len", "d"),
                ("makespan s", "makespan_s", ".2f"), ("bubble", "bubble_ratio", ".3f"), ("tail s", "tail_s", ".2f"),
                ("migrations", "migrations", "d")]
TARGET_COLUMNS = [("workload", "workload", "s"), ("workers", "workers", "d"),
                  ("static bubble", "static_bubble", ".3f"), ("bubble", "bubble", ".3f"),
                  ("<= 0.05", "bubble_met", ""), ("makespan / oracle", "makespan_vs_oracle", ".3f"),
                  ("<= 1.15", "makespan_met", ""), ("tail cut vs static", "tail_reduction", ".1%"),
                  (">= 75%", "tail_met", "")]

NOTES = """## How the oracle is computed

The `oracle` rows are a lower bound, not a schedule (true lengths known, perfect packing):

- makespan >= max(longest single request, fleet work / workers). A request alone on a worker
  takes prefill(prompt) + length x forward(1 token): a sequence is sequential, no schedule
  splits it. Fleet work counts every decode token at the cheapest per-token cost of the curve
  (a full batch of `capacity` sequences) and every prompt token at the curve's smallest slope.
- bubble >= max(0, 1 - sum(each request alone) / (workers x makespan)): the most busy
  worker-time the requests can produce is each running alone; it is 0 here.
- tail >= 0: perfect packing can end every request at the makespan.

## What each workload shows

- `heavy_tail`: a sample's length is mostly its prompt's (RhymeRL: few prompts change length
  rank between epochs), and 3% of prompts jump each epoch. At 256 samples per worker and 8
  running at once, the fleet's work, not one sample, sets the floor, so a bubble near 0 is
  possible. rhymerl sends each group's first sample ahead (a scout): a prompt whose length
  changed shows it within a chunk, and its siblings are pulled forward before they can start
  late. At 4,096 workers a step holds 1M samples and its makespan is set by one or two samples
  4-5 sigma above their own group's median that started in the step's last fifth;
  `python -m benchmarks.prediction_limit` (results/prediction_limit.md) runs the same policy
  with each prompt's true length law as its history, to separate what better prediction
  could win from what no scheduler without foresight can; results/prediction_limit_4096.md
  has three seeds at 4,096 workers, where the rows above run one.
- `heavy_tail_runaways`: the same plus 1% of samples that loop to max_tokens at random. A
  runaway looks like its siblings until it outgrows its prompt's history, so a policy without
  foresight finds the last runaways only when most of the step's work is done, and each still
  needs about 84 s after that. The oracle knows them from the start; no history does. rhymerl
  runs every exposed runaway first (its prediction jumps to max_tokens), which keeps the
  bubble low, but its makespan stays near "the step without runaways + one runaway".
- `traces`: the recorded RL-loop traces, tiled; short responses (median under 100 tokens), so
  prefills and the event quantum are a visible share of the step.
- The earlier shape, `--samples-per-worker 32`, puts one 16K-token sample at 3.6x a worker's
  full-batch share of the work: that sample is the floor, and most of the fleet idles under
  any schedule that does not hold work back just to look busy.
- `static` pins each prompt's group to one worker, as veRL's even split of a batch does.

## How to read these numbers

- Simulated, not measured on GPUs: worker speed is the forward-time curve of docs/cost-model.md
  (weight matrices only). A migration is charged a re-prefill of prompt + generated tokens
  on the destination; resuming on the same worker is free (prefix cache).
- The bubble counts a worker as busy while it runs at least one sequence (the issue's
  definition). On this cost curve a sequence decodes almost as fast alone as in a batch of
  8, so a worker running one sequence is "busy" while most of its batch is empty.
- Live rows: real workers (tiny random model, CPU) through the real scheduler; their
  lengths come from the random model and are not heavy-tailed unless the table says so.
  They show the whole path working and the scheduler's own metrics, not placement
  quality: the in-process workers are threads of one Python process, and with a tiny
  model an engine step is mostly Python, so the workers barely run in parallel. A policy
  that leaves workers idle puts more sequences in each step of the busy ones, takes
  fewer steps in all and finishes sooner (histopipe, bubble 0.3, at about half the others'
  makespan with 4 workers; with `--live-workers 2` all four policies land within 15%).
  Placement quality is what the simulated rows measure. The live GPU run in
  `make bench-gpu` uses the same in-process cluster, so it shares this caveat in part
  (the kernels run in parallel; the Python between them does not).
"""
