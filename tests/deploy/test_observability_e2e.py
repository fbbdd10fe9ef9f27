"""End to end: what an operator sees in Prometheus is what the trainer saw in the SDK.

The real processes (history with its redis-server, scheduler, two CPU workers) are
scraped by a real Prometheus (Debian's /usr/bin/prometheus) every second, with
deploy/prometheus/rules.yml evaluated every second. A short RL-like loop runs
(greedy rollouts of the same prompts, rewards, a weight update, more rollouts: from
the second epoch on history supplies drafts). Then, over Prometheus's HTTP API:

- the acceptance rate from the counters equals the SDK's accepted / drafted tokens;
- the last-step gauges (bubble ratio, makespan, tail, spec tokens) equal the last summary;
- every recording rule evaluates without error and the acceptance-rate rules agree
  with the counters;
- every Grafana panel query parses, and every series it names is one that the live
  services export, or a recorded series that the live rules produce.

The static checks (names against services/common/metrics.py, promtool parse checks)
are in test_observability.py; this test catches what they cannot: a metric defined
but never exported by any process, labels that never appear, a rule that yields nothing.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import yaml
from rhymerl import Prompt, RolloutClient, SamplingParams, StepSummary

from services.local import LocalCluster
from tests.deploy.prometheus_server import BINARY, PrometheusServer, PromQLError
from tests.deploy.test_observability import (
    PROMETHEUS,
    SCRAPE_SERIES,
    dashboard_queries,
    recorded_series,
    series_in,
    substitute,
)
from tests.e2e.cluster import save_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NUM_WORKERS = 2
PROMPTS = [Prompt(f"q{i}", [3 + i, 5, 7, 9]) for i in range(4)]
N = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, seed=0, ignore_eos=True)
EPOCHS = 3

ACCEPTED = "rhymerl:spec_decode_num_accepted_tokens_total"
DRAFTED = "rhymerl:spec_decode_num_draft_tokens_total"
RATE_RULE = "rhymerl:spec_decode_acceptance_rate:rate1m"
RATE_BY_WORKER_RULE = "rhymerl:spec_decode_acceptance_rate_by_worker:rate1m"


@dataclass
class Observed:
    cluster: LocalCluster
    prom: PrometheusServer
    summaries: list[StepSummary]
    policy_version: int

    @property
    def drafted(self) -> int:
        return sum(s.num_draft_tokens for s in self.summaries)

    @property
    def accepted(self) -> int:
        return sum(s.num_accepted_tokens for s in self.summaries)


def reward(token_ids: list[int]) -> float:
    """A stand-in verifier: the share of even tokens."""
    return sum(t % 2 == 0 for t in token_ids) / max(1, len(token_ids))


def rl_loop(client: RolloutClient, model_dir: str) -> tuple[list[StepSummary], int]:
    """rollout -> rewards -> (after the first epoch) a weight update -> rollout ...

    The "update" reloads the same checkpoint as version 1, so greedy outputs repeat and
    history's drafts of earlier epochs are accepted."""
    summaries, version = [], 0
    for epoch in range(EPOCHS):
        step = client.rollout(f"epoch-{epoch}", PROMPTS, n=N, sampling=GREEDY, policy_version=version)
        assert len(step.samples) == len(PROMPTS) * N
        assert all(s.policy_version == version for s in step.samples)
        client.report_rewards(f"epoch-{epoch}", [(s.prompt_id, s.sample_index, reward(s.token_ids))
                                                 for s in step.samples])
        summaries.append(step.summary)
        if epoch == 0:
            version = client.load_weights(1, model_dir)
            assert version == 1
    return summaries, version


def wait_for_series(prom: PrometheusServer, name: str, count: int) -> None:
    """Waits until Prometheus holds `count` series of `name`; says why when it holds them renamed."""
    try:
        prom.wait_for(lambda: len(prom.query(name)) == count, f"{count} series of {name}")
    except TimeoutError:
        escaped = name.replace(":", "_")
        if prom.query(escaped):
            pytest.fail(f"Prometheus stores {escaped}, not {name}: the services' /metrics answer Prometheus's "
                        "OpenMetrics 1.0.0 Accept header with escaping=underscores, which turns ':' into '_' "
                        "(prometheus_client, client_python#1177), so no rhymerl: rule or dashboard query finds data",
                        pytrace=False)
        raise


@pytest.fixture(scope="module")
def observed(tmp_path_factory):
    if not BINARY.exists():
        pytest.skip(f"{BINARY} missing: `make install` installs Debian's prometheus")
    tmp = tmp_path_factory.mktemp("observability_e2e")
    model = save_tiny_model(tmp / "model")
    # Drafts sized by the H100 table, not by this machine's measured speed: epochs 2+ always draft.
    cluster = LocalCluster(model_dir=str(model), num_workers=NUM_WORKERS, policy="seer", chunk_tokens=16,
                           log_dir=tmp / "logs", extra_env={"RHYMERL_WORKER_MEASURE_COST": "false"})
    prom = None
    try:
        cluster.start()
        workers = [f"worker-{i}" for i in range(NUM_WORKERS)]
        jobs = {  # the job and component labels of deploy/prometheus/prometheus.yml
            "history": ([f"127.0.0.1:{cluster.metrics_ports['history']}"], {"component": "history"}),
            "scheduler": ([f"127.0.0.1:{cluster.metrics_ports['scheduler']}"], {"component": "scheduler"}),
            "worker": ([f"127.0.0.1:{cluster.metrics_ports[w]}" for w in workers], {"component": "worker"}),
        }
        prom = PrometheusServer(tmp / "prometheus", jobs=jobs, rules_file=PROMETHEUS / "rules.yml").start()
        # Every target scraped once before any work: the counters' first samples are 0.
        prom.wait_for(lambda: prom.value('sum(up{component=~"history|scheduler|worker"})') == 2 + NUM_WORKERS,
                      "all targets up")
        wait_for_series(prom, DRAFTED, NUM_WORKERS)
        with RolloutClient(cluster.scheduler_address, timeout_s=120) as client:
            summaries, version = rl_loop(client, str(model))
        obs = Observed(cluster, prom, summaries, version)
        # Wait for a scrape after the last step: the counters equal what the SDK saw.
        prom.wait_for(lambda: (prom.value(f"sum({DRAFTED})"), prom.value(f"sum({ACCEPTED})"))
                      == (obs.drafted, obs.accepted), "the final spec-decode counters")
        prom.wait_for(lambda: prom.value("sum(rhymerl:steps_total{status=\"finished\"})") == EPOCHS,
                      "the scheduler's last step")
        yield obs
    finally:
        if prom is not None:
            prom.stop()
        cluster.stop()


def scheduler_gauge(prom: PrometheusServer, name: str) -> float | None:
    """A last-step gauge as the scheduler exports it (every process exports it, at 0 where unused)."""
    return prom.value(f'{name}{{component="scheduler"}}')


def test_the_loop_drafted_from_history(observed):
    """Precondition of the checks below: epochs 2+ drafted and accepted tokens."""
    first, *later = observed.summaries
    assert first.history_hit_rate == 0.0
    for s in later:
        assert s.history_hit_rate == 1.0
        assert s.num_draft_tokens > 0 and s.num_accepted_tokens > 0, s


def test_acceptance_rate_in_prometheus_equals_the_sdk(observed):
    prom = observed.prom
    assert prom.value(f"sum({DRAFTED})") == observed.drafted
    assert prom.value(f"sum({ACCEPTED})") == observed.accepted
    rate = prom.value(f"sum({ACCEPTED}) / sum({DRAFTED})")
    assert rate == pytest.approx(observed.accepted / observed.drafted, abs=1e-9)
    assert 0 < rate <= 1
    # The scheduler's per-step view of the same counters agrees with the last summary.
    last = observed.summaries[-1]
    assert scheduler_gauge(prom, "rhymerl:step_spec_draft_tokens") == last.num_draft_tokens
    assert scheduler_gauge(prom, "rhymerl:step_spec_accepted_tokens") == last.num_accepted_tokens


def test_step_gauges_equal_the_last_summary(observed):
    prom, last = observed.prom, observed.summaries[-1]
    assert scheduler_gauge(prom, "rhymerl:step_bubble_ratio") == pytest.approx(last.bubble_ratio, abs=1e-6)
    assert 0 <= last.bubble_ratio < 1
    assert scheduler_gauge(prom, "rhymerl:step_makespan_seconds") == pytest.approx(last.makespan_s, abs=1e-6)
    assert scheduler_gauge(prom, "rhymerl:step_tail_seconds") == pytest.approx(last.tail_time_s, abs=1e-6)
    assert prom.value("sum(rhymerl:generation_tokens_total)") == sum(s.num_generated_tokens
                                                                     for s in observed.summaries)
    assert prom.value("sum(rhymerl:samples_total)") == EPOCHS * len(PROMPTS) * N
    assert prom.value('max(rhymerl:weight_version{component="scheduler"})') == observed.policy_version


def test_recording_rules_evaluate_and_agree_with_the_counters(observed):
    prom = observed.prom
    # Every rule of rules.yml is loaded and its last evaluation succeeded.
    groups = prom.rule_groups()
    loaded = {r["name"] for g in groups for r in g["rules"] if r["type"] == "recording"}
    assert loaded == recorded_series()
    broken = {r["name"]: r.get("lastError") for g in groups for r in g["rules"] if r["health"] != "ok"}
    assert not broken, broken

    # Wait for an evaluation that saw the final counters (they were scraped by now).
    settled = max(float(row["value"][1]) for row in prom.query(f"timestamp({DRAFTED})"))
    prom.wait_for(lambda: (prom.value(f"min(timestamp({RATE_BY_WORKER_RULE}))") or 0) > settled + 0.5,
                  f"an evaluation of {RATE_BY_WORKER_RULE} after the last scrape")
    now = time.time()
    overall = prom.value(RATE_RULE, at=now)
    assert overall is not None and 0 <= overall <= 1

    # Per worker: rate(accepted)/rate(drafted) over one series pair sharing scrape times is
    # exactly accepted/drafted when the 1m window holds the whole series (first sample 0).
    by_worker = {r["metric"]["worker"]: float(r["value"][1]) for r in prom.query(RATE_BY_WORKER_RULE, at=now)}
    assert set(by_worker) == {f"worker-{i}" for i in range(NUM_WORKERS)}
    accepted = {r["metric"]["worker"]: float(r["value"][1]) for r in prom.query(ACCEPTED, at=now)}
    drafted = {r["metric"]["worker"]: float(r["value"][1]) for r in prom.query(DRAFTED, at=now)}
    rule_time = prom.value(f"max(timestamp({RATE_BY_WORKER_RULE}))", at=now)
    ratios = {}
    for worker, rate in by_worker.items():
        assert math.isnan(rate) == (drafted[worker] == 0), (worker, rate)
        if drafted[worker] == 0:
            continue
        ratios[worker] = accepted[worker] / drafted[worker]
        assert 0 <= rate <= 1
        history = prom.query(f"{DRAFTED}{{worker=\"{worker}\"}}[10m]", at=now)[0]["values"]
        first_ts, first_value = float(history[0][0]), float(history[0][1])
        if first_value == 0 and first_ts > rule_time - 55:
            assert rate == pytest.approx(ratios[worker], rel=1e-9), worker
    # The overall rate is a weighted mean of the workers' (each extrapolated on its own scrape
    # times), so it lies between them, as does the SDK's exact ratio.
    assert min(ratios.values()) - 1e-9 <= overall <= max(ratios.values()) + 1e-9
    assert min(ratios.values()) - 1e-9 <= observed.accepted / observed.drafted <= max(ratios.values()) + 1e-9


def test_every_dashboard_query_parses_and_reads_live_series(observed):
    prom = observed.prom
    recorded = recorded_series()
    rules = {r["record"]: r["expr"] for g in yaml.safe_load((PROMETHEUS / "rules.yml").read_text())["groups"]
             for r in g["rules"] if "record" in r}
    # Recorded series need an evaluation after their inputs exist: give the rules a few rounds.
    wanted = {name for _, _, expr in dashboard_queries() for name in series_in(substitute(expr)) if name in recorded}
    # A rate() needs two scrapes of a series inside its window: a series born late in the
    # run (the last weight update, history reads) needs a few more scrape intervals.
    queries = [substitute(expr) for _, _, expr in dashboard_queries()]

    def all_have_data() -> bool:
        if not wanted <= prom.metric_names():
            return False
        for query in queries:
            try:
                if not prom.query(query):
                    return False
            except PromQLError:
                continue  # reported below
        return True
    try:
        prom.wait_for(all_have_data, "every dashboard query has data", timeout_s=30, poll_s=1.0)
    except TimeoutError:
        pass  # reported per panel below
    live = prom.metric_names()
    problems = []
    for board, title, expr in dashboard_queries():
        query = substitute(expr)
        try:
            result = prom.query(query)
        except PromQLError as err:
            problems.append(f"{board} / {title}: {query!r} does not parse: {err}")
            continue
        if not result:
            problems.append(f"{board} / {title}: {query!r} shows no data")
        for name in sorted(series_in(query)):
            if name in live:
                continue
            if name in recorded:
                inputs = sorted(series_in(rules[name]) - live)
                problems.append(f"{board} / {title}: recorded series {name} never produced by the live rules"
                                + (f" (no live service exports {', '.join(inputs)})" if inputs else ""))
            elif name in SCRAPE_SERIES:
                problems.append(f"{board} / {title}: {name} missing although Prometheus scrapes the targets")
            else:
                problems.append(f"{board} / {title}: {name} is exported by no live service")
    assert not problems, "\n".join(problems)


def test_a_broken_query_is_reported_as_bad_data(observed):
    """The parse check above is worth something: Prometheus rejects a broken query."""
    with pytest.raises(PromQLError) as err:
        observed.prom.query("sum(rate(rhymerl:generation_tokens_total[1m])")
    assert err.value.error_type == "bad_data"
