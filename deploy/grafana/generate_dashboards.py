"""Generates the rhymerl Grafana dashboard (dashboards/rhymerl-overview.json).

    python deploy/grafana/generate_dashboards.py           # rewrite the JSON
    python deploy/grafana/generate_dashboards.py --check   # exit 1 if it is stale

Built with grafana-foundation-sdk (Grafana Labs' typed dashboard builders). Panels
read the recording rules of deploy/prometheus/rules.yml where one exists and the
raw metrics of services/common/metrics.py otherwise; tests/deploy/test_observability.py
checks that every query parses and names only those series. Edit this file, not
the JSON.
"""

from __future__ import annotations

import itertools
import json
import string
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common, stat, timeseries
from grafana_foundation_sdk.builders.dashboard import Dashboard, DatasourceVariable, QueryVariable, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import BigValueGraphMode
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef, VariableRefresh

OUT = Path(__file__).parent / "dashboards" / "rhymerl-overview.json"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
WORKER = 'worker=~"$worker"'
_panel_ids = itertools.count(1)


def query(expr: str, legend: str = "") -> Dataquery:
    q = Dataquery().expr(expr).datasource(DATASOURCE)
    return q.legend_format(legend) if legend else q


def graph(title: str, description: str, unit: str, *queries: Dataquery, width: int = 8) -> timeseries.Panel:
    panel = (timeseries.Panel().id(next(_panel_ids)).title(title).description(description).unit(unit)
             .datasource(DATASOURCE).height(8).span(width).line_width(1).fill_opacity(10).show_points("never"))
    for ref_id, q in zip(string.ascii_uppercase, queries):
        panel = panel.with_target(q.ref_id(ref_id))
    return panel


def single(title: str, description: str, unit: str, q: Dataquery, width: int = 4) -> stat.Panel:
    return (stat.Panel().id(next(_panel_ids)).title(title).description(description).unit(unit)
            .datasource(DATASOURCE).height(4).span(width).with_target(q.ref_id("A"))
            .graph_mode(BigValueGraphMode.AREA).reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"])))


def steps_row(d: Dashboard) -> Dashboard:
    return (d.with_row(Row("Steps (scheduler)").id(next(_panel_ids)))
            .with_panel(single("Healthy workers", "Workers the scheduler considers healthy.", "none",
                               query('sum(rhymerl:workers_registered{healthy="true"})')))
            .with_panel(single("Unhealthy workers", "Registered workers failing health checks.", "none",
                               query('sum(rhymerl:workers_registered{healthy="false"})')))
            .with_panel(single("Queue depth", "Requests waiting for a worker.", "none",
                               query("sum(rhymerl:queue_depth)")))
            .with_panel(single("Last makespan", "Wall time of the last finished step.", "s",
                               query("max(rhymerl:step_makespan_seconds)")))
            .with_panel(single("Last bubble ratio", "Idle worker-seconds / worker-seconds in the last step.",
                               "percentunit", query("max(rhymerl:step_bubble_ratio)")))
            .with_panel(single("Policy version", "Weight version the scheduler serves.", "none",
                               query('max(rhymerl:weight_version{component="scheduler"})')))
            .with_panel(graph("Makespan per step", "Makespan of each finished step, and its distribution.", "s",
                              query("max(rhymerl:step_makespan_seconds)", "last step"),
                              query("histogram_quantile(0.5, sum by (le) "
                                    "(rate(rhymerl:step_makespan_seconds_dist_bucket[$__rate_interval])))", "p50"),
                              query("histogram_quantile(0.95, sum by (le) "
                                    "(rate(rhymerl:step_makespan_seconds_dist_bucket[$__rate_interval])))", "p95")))
            .with_panel(graph("Bubble ratio and tail per step",
                              "Bubble ratio (left): idle GPU time of the step. Tail (right): time to finish the "
                              "last 10% of its samples; both fall when scheduling works.", "percentunit",
                              query("max(rhymerl:step_bubble_ratio)", "bubble ratio"),
                              query("max(rhymerl:step_tail_seconds)", "tail (s)"))
                        .override_by_name("tail (s)", [{"id": "unit", "value": "s"},
                                                       {"id": "custom.axisPlacement", "value": "right"}]))
            .with_panel(graph("Trainer vs rollout logprobs",
                              "What trainers report with ReportLogprobs (their recomputed logprobs of a step's "
                              "samples). Left: KL(rollout || trainer) (k3 estimate) and mean |rollout - trainer "
                              "logprob| of the last reported step, p99 of the per-token difference. Right: share of "
                              "tokens whose logprobs match bit for bit (1 with batch-invariant workers and "
                              "rhymerl's reference).", "none",
                              query("max(rhymerl:step_trainer_logprob_kl)", "KL, last step"),
                              query("max(rhymerl:step_trainer_logprob_abs_diff)", "mean |diff|, last step"),
                              query("histogram_quantile(0.99, sum by (le) "
                                    "(rate(rhymerl:trainer_logprob_abs_diff_bucket[$__rate_interval])))",
                                    "p99 |diff| per token"),
                              query('sum(rate(rhymerl:trainer_logprob_abs_diff_bucket{le="0.0"}[$__rate_interval])) '
                                    "/ sum(rate(rhymerl:trainer_logprob_abs_diff_count[$__rate_interval]))",
                                    "bitwise identical"))
                        .override_by_name("bitwise identical", [{"id": "unit", "value": "percentunit"},
                                                                {"id": "custom.axisPlacement", "value": "right"}]))
            .with_panel(graph("Queue depth, steps and samples", "Waiting requests; steps and samples per second.",
                              "short", query("sum(rhymerl:queue_depth)", "queued requests"),
                              query("sum by (status) (rate(rhymerl:steps_total[$__rate_interval]))", "steps {{status}}/s"),
                              query("sum by (finish_reason) (rate(rhymerl:samples_total[$__rate_interval]))",
                                    "samples {{finish_reason}}/s"),
                              query("sum(rate(rhymerl:migrations_total[$__rate_interval]))", "migrations/s"))))


def speculation_row(d: Dashboard) -> Dashboard:
    return (d.with_row(Row("Speculative decoding (HistoSpec)").id(next(_panel_ids)))
            .with_panel(graph("Acceptance rate", "Accepted / proposed draft tokens (recording rule).",
                              "percentunit", query("rhymerl:spec_decode_acceptance_rate:rate1m", "all workers"),
                              query(f"rhymerl:spec_decode_acceptance_rate_by_worker:rate1m{{{WORKER}}}", "{{worker}}"))
                        .min(0).max(1))
            .with_panel(graph("Mean acceptance length",
                              "Tokens per verify step: 1 + accepted / drafts. 1 means drafting bought nothing.",
                              "none", query("rhymerl:spec_decode_mean_acceptance_length:rate1m", "all workers"),
                              query(f"rhymerl:spec_decode_mean_acceptance_length_by_worker:rate1m{{{WORKER}}}",
                                    "{{worker}}")).min(1))
            .with_panel(graph("Acceptance by draft position",
                              "Probability that the draft token at each position was accepted: where it nears 0 "
                              "is where longer drafts stop paying.", "percentunit",
                              query("rhymerl:spec_decode_acceptance_rate_by_position:rate1m", "position {{position}}"))
                        .min(0).max(1))
            .with_panel(graph("Drafts without a history match",
                              "Share of draft requests for which the drafter found no match.", "percentunit",
                              query("rhymerl:drafter_no_match_ratio:rate1m", "no match")).min(0).max(1))
            .with_panel(graph("Draft trees by batch size",
                              "Tokens accepted per draft tree and per verified tree node, by the step's batch-size "
                              "bucket: where trees pay (docs/drafter.md, Draft trees). Empty with trees off.", "none",
                              query("sum by (batch) (rate(rhymerl:spec_tree_accepted_tokens_total[$__rate_interval])) "
                                    "/ sum by (batch) (rate(rhymerl:spec_tree_drafts_total[$__rate_interval]))",
                                    "accepted per tree, batch <= {{batch}}"),
                              query("sum by (batch) (rate(rhymerl:spec_tree_accepted_tokens_total[$__rate_interval])) "
                                    "/ sum by (batch) (rate(rhymerl:spec_tree_nodes_total[$__rate_interval]))",
                                    "accepted per node, batch <= {{batch}}")).min(0))
            .with_panel(graph("Draft tree shape", "Median width (most nodes at one depth) and depth of the trees.",
                              "none",
                              query("histogram_quantile(0.5, sum by (le) "
                                    "(rate(rhymerl:spec_tree_width_bucket[$__rate_interval])))", "width p50"),
                              query("histogram_quantile(0.5, sum by (le) "
                                    "(rate(rhymerl:spec_tree_depth_bucket[$__rate_interval])))", "depth p50")).min(0)))


def workers_row(d: Dashboard) -> Dashboard:
    return (d.with_row(Row("Rollout workers").id(next(_panel_ids)))
            .with_panel(graph("Generated tokens/s per worker", "Tokens sampled per second.", "short",
                              query(f"rhymerl:generation_tokens_by_worker:rate1m{{{WORKER}}}", "{{worker}}"),
                              query("rhymerl:generation_tokens:rate1m", "total")))
            .with_panel(graph("Busy ratio per worker", "Fraction of time each engine had work (1 - bubble).",
                              "percentunit",
                              query(f"rhymerl:worker_busy_ratio_by_worker:rate1m{{{WORKER}}}", "{{worker}}"))
                        .min(0).max(1))
            .with_panel(graph("KV cache usage", "Fraction of KV-cache blocks in use.", "percentunit",
                              query(f"max by (worker) (rhymerl:kv_cache_usage_perc{{{WORKER}}})", "{{worker}}"))
                        .min(0).max(1))
            .with_panel(graph("Running and waiting sequences", "Batch occupancy of each engine.", "short",
                              query(f"sum by (worker) (rhymerl:num_requests_running{{{WORKER}}})", "{{worker}} running"),
                              query(f"sum by (worker) (rhymerl:num_requests_waiting{{{WORKER}}})", "{{worker}} waiting")))
            .with_panel(graph("Engine step time", "p50 and p99 of one engine step by kind (recording rules).", "s",
                              query("rhymerl:engine_step_seconds:p50_rate1m", "p50 {{kind}}"),
                              query("rhymerl:engine_step_seconds:p99_rate1m", "p99 {{kind}}")))
            .with_panel(graph("Garbage collection", "Fraction of time each worker's garbage collector paused it: "
                              "behind a step's forward (RHYMERL_WORKER_GC_THRESHOLDS), or elsewhere (automatic "
                              "collections: in a step's host work, or idle).", "percentunit",
                              query(f"sum by (worker, where) (rate(rhymerl:gc_pause_seconds_sum{{{WORKER}}}"
                                    "[$__rate_interval]))", "{{worker}} {{where}}")))
            .with_panel(graph("Prefill tokens/s", "Prompt tokens prefilled per second (re-prefills included).",
                              "short", query(f"sum by (worker) (rate(rhymerl:prompt_tokens_total{{{WORKER}}}"
                                             "[$__rate_interval]))", "{{worker}}")))
            .with_panel(graph("Drafter feed", "Responses waiting for the drafter's global index (finished samples "
                              "and the history stream, inserted behind the engine's forwards a few thousand tokens "
                              "a step), and those it takes per second.", "short",
                              query(f"sum by (worker) (rhymerl:drafter_feed_pending_responses{{{WORKER}}})",
                                    "waiting {{worker}}"),
                              query(f"sum by (worker) (rate(rhymerl:drafter_feed_responses_total{{{WORKER}}}"
                                    "[$__rate_interval]))", "taken/s {{worker}}"))))


def health_row(d: Dashboard) -> Dashboard:
    return (d.with_row(Row("Health, weights and history").id(next(_panel_ids)))
            .with_panel(graph("Targets up", "Prometheus scrape health of every rhymerl process.", "none",
                              query('sum by (component) (up{component=~"history|scheduler|worker|router"})', "{{component}} up"),
                              query('sum by (healthy) (rhymerl:workers_registered)', "registered healthy={{healthy}}")))
            .with_panel(graph("Weight version", "Policy version each component serves; workers should follow the "
                              "scheduler within one weight update.", "none",
                              query("max by (component) (rhymerl:weight_version)", "{{component}}")))
            .with_panel(graph("Weight update time", "p95 time to apply a weight update.", "s",
                              query("histogram_quantile(0.95, sum by (component, le) "
                                    "(rate(rhymerl:weight_update_seconds_bucket[$__rate_interval])))", "{{component}}")))
            .with_panel(graph("History hit rate", "Looked-up prompts that had earlier epochs stored (recording rule).",
                              "percentunit", query("rhymerl:history_hit_ratio:rate5m", "hit rate")).min(0).max(1))
            .with_panel(graph("History traffic", "History RPCs and rollouts stored per second.", "reqps",
                              query("sum by (method) (rate(rhymerl:history_requests_total[$__rate_interval]))", "{{method}}"),
                              query("sum(rate(rhymerl:history_rollouts_written_total[$__rate_interval]))",
                                    "rollouts written"))))


def build() -> dict:
    global _panel_ids
    _panel_ids = itertools.count(1)
    dashboard = (Dashboard("rhymerl — rollout overview").uid("rhymerl-overview")
                 .description("Steps, speculative decoding, workers and history of a rhymerl deployment.")
                 .tags(["rhymerl"]).refresh("10s").time("now-1h", "now").timezone("browser")
                 .tooltip(DashboardCursorSync.CROSSHAIR).editable()
                 .with_variable(DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
                 .with_variable(QueryVariable("worker").label("Worker").datasource(DATASOURCE)
                                .query("label_values(rhymerl:generation_tokens_total, worker)")
                                .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
                                .multi(True).include_all(True).all_value(".*")))
    for row in (steps_row, speculation_row, workers_row, health_row):
        dashboard = row(dashboard)
    return json.loads(json.dumps(dashboard.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python {Path(__file__).as_posix()}", file=sys.stderr)
            return 1
        return 0
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
