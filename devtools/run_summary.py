"""The summary `make run` ends with: a table of the GRPO steps, what each column means,
what this run's numbers show, and where to look next.

Input: the rows `grpo_trainer.run` returns (one dict per step, see its `step_stats`).
"""

from __future__ import annotations

import math
import textwrap

COLUMNS = ("step", "reward", "mean len", "hist hits", "hist match", "acc/verify", "acceptance", "step s",
           "tokens", "via drafts", "decoded")

GLOSSARY = """\
  reward      mean task reward of the step's samples, 0..1: 1 for a right final answer, else
              partial credit x the share of the worked steps reproduced (--partial-credit)
  mean len    mean response length in tokens
  hist hits   prompts that had earlier-epoch rollouts in the history service (step 0: none)
  hist match  tokens a longest-suffix match against the same prompt's responses of the step
              before predicts (the trainer's own measure: how much the last epoch could draft)
  acc/verify  draft tokens accepted per verify forward that carried a draft: each one is a
              forward pass the sequence did not need
  acceptance  accepted / proposed draft tokens (drafts from earlier epochs and from siblings)
  step s      rollout time of the step (first dispatch to last sample), on this machine
  tokens      tokens generated: `via drafts` came in accepted drafts, `decoded` one per forward
In the per-step lines above: `accept X% of N draft tokens` is acceptance over the N tokens
proposed in drafts (a draft is several tokens); `update` the trainer's gradient steps and
`loss` the first one's PPO-clipped loss (minimised; its sign means nothing by itself);
`-> vN` the weight version the update was pushed as. The `greedy reward` of the training
printout is the task reward of the tiny policy's most likely answers before RL."""


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.0f}%"


def _cells(row: dict) -> list[str]:
    generated, accepted = row["num_generated_tokens"], row["num_accepted_tokens"]
    per_verify = accepted / row["num_verify_steps"] if row["num_verify_steps"] else float("nan")
    return [str(row["step"]), f"{row['reward']:.3f}", f"{row['mean_length']:.0f}", _pct(row["history_hit_rate"]),
            _pct(row["history_match"]), "-" if math.isnan(per_verify) else f"{per_verify:.2f}", _pct(row["acceptance_rate"]),
            f"{row['makespan_s']:.1f}", str(generated), str(accepted), str(generated - accepted)]


def table(rows: list[dict]) -> str:
    cells = [list(COLUMNS)] + [_cells(r) for r in rows]
    total_gen = sum(r["num_generated_tokens"] for r in rows)
    total_acc = sum(r["num_accepted_tokens"] for r in rows)
    cells.append(["all", "", "", "", "", "", "", f"{sum(r['makespan_s'] for r in rows):.1f}", str(total_gen),
                  str(total_acc), str(total_gen - total_acc)])
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in cells)


def findings(rows: list[dict], measure_cost: bool) -> list[str]:
    """What this run's numbers show, in a few sentences computed from them."""
    first, later = rows[0], rows[1:]
    share = lambda rs: (sum(r["num_accepted_tokens"] for r in rs)  # noqa: E731
                        / max(1, sum(r["num_generated_tokens"] for r in rs)))
    out = [f"Step 0 had no history: its {_pct(share([first]))} of tokens via drafts came from sibling samples "
           "of the same prompt and from the prompt itself."]
    if later:
        out.append(f"Steps 1-{len(rows) - 1} drafted from the previous epochs too: {_pct(share(later))} of their "
                   f"tokens came in accepted drafts, {sum(r['num_accepted_tokens'] for r in later)} forward passes "
                   "of single sequences saved.")
        out.append(f"Reward went from {first['reward']:.3f} to {rows[-1]['reward']:.3f} over {len(rows)} steps "
                   "(a short, noisy run: the point here is the service, not the training).")
    if measure_cost:
        out.append("The workers measured this machine's forward cost and drafted only where it paid, so the number "
                   "of drafts follows the machine's load from step to step.")
    else:
        out.append("The workers sized their drafts by the H100 cost table (docs/cost-model.md), so drafting is the "
                   "same on every machine. Step times are this CPU's and say little about a GPU, where a forward "
                   "over a few hundred tokens costs about as much as a forward over one (so an accepted draft "
                   "token is nearly free there); `python -m benchmarks.engine_bench --device cuda` measures that "
                   "(benchmarks/results/engine.md).")
    out.append("This run does not time a rollout without drafts, so it does not say whether rhymerl made this "
               "rollout faster: it shows how many forward passes the drafts saved (`via drafts`). On a CPU a "
               "verify forward costs more per token than on a GPU, and the speed-up is measured, with and without "
               "drafts, by `python -m benchmarks.engine_bench` (benchmarks/results/engine.md).")
    return out


NEXT = """\
  logs        runs/local/*.log (each service's own log, kept after the run)
  metrics     the services are stopped now; started by hand (README, "Running the services
              yourself") each serves Prometheus /metrics (names in services/common/metrics.py),
              and `docker compose up --build` adds Prometheus and the Grafana dashboards
              (http://localhost:3000, deploy/grafana/dashboards/)
  benchmarks  `make bench`; results with their commands in benchmarks/results/*.md
  your code   the trainer above is clients/python/examples/grpo_trainer.py, SDK only:
              `pip install ./clients/python`, then see clients/python/examples/README.md"""


def summary(rows: list[dict], measure_cost: bool) -> str:
    if not rows:
        return "no steps ran"
    parts = ["", "Summary of the GRPO steps", table(rows), "", "What the columns mean", GLOSSARY, "",
             "What this run shows", *[textwrap.fill(line, 100, initial_indent="  ", subsequent_indent="  ")
                                      for line in findings(rows, measure_cost)], "",
             "Where to look next", NEXT]
    return "\n".join(parts)
