"""Prometheus config, recording rules and Grafana dashboards agree with the metrics.

If these fail, a dashboard panel or a recording rule would silently show "No data":
a query that does not parse, a metric name that services/common/metrics.py does not
export (a typo, a renamed metric, a counter without `_total`), a recorded series no
rule records, or a committed dashboard JSON that its generator no longer produces.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from prometheus_client.metrics import MetricWrapperBase

from services.common import metrics

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS = REPO / "deploy" / "prometheus"
GRAFANA = REPO / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
# Series Prometheus itself adds to every scrape.
SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h", "$worker": ".*"}



def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs Debian's promtool (package prometheus, installed by `make install`)."""
    assert shutil.which("promtool"), "promtool missing: `make install` installs Debian's prometheus"
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def exported_series() -> set[str]:
    """Every series name services/common/metrics.py exposes on /metrics."""
    names = set()
    for value in vars(metrics).values():
        if isinstance(value, metrics.BulkHistogram):  # a histogram observed an array at a time
            names |= {value.name + s for s in ("_bucket", "_sum", "_count")}
        if not isinstance(value, MetricWrapperBase):
            continue
        name, kind = value._name, value._type
        if kind == "counter":
            names |= {name + "_total", name + "_created"}
        elif kind == "histogram":
            names |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(name)
    return names


def recorded_series() -> set[str]:
    rules = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    return {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


def series_in(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (not functions, labels or keywords)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    expr = re.sub(r"\{[^}]*\}", "", expr)                     # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)                    # range selectors
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word, rest = match.group(), expr[match.end():].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expr) of every target and query variable."""
    found = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                found.append((path.name, panel["title"], target["expr"]))
    return found


def substitute(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr}"
    return expr


def promtool_check_exprs(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    rules = {"groups": [{"name": "parse", "rules": [
        {"record": f"parse:expr_{i}", "expr": e} for i, e in enumerate(exprs)]}]}
    path = tmp_path / "exprs.yml"
    path.write_text(yaml.safe_dump(rules))
    return promtool("check", "rules", str(path))


# --- Prometheus -------------------------------------------------------------------------

def test_prometheus_config_and_rules_are_valid():
    proc = promtool("check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_recording_rules_compute_what_they_say():
    """promtool unit tests: acceptance rate = accepted/drafted, length = 1 + accepted/drafts, ..."""
    proc = promtool("test", "rules", "rules_test.yml", cwd=PROMETHEUS)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rules_read_only_exported_metrics():
    rules = yaml.safe_load((PROMETHEUS / "rules.yml").read_text())
    known = exported_series() | SCRAPE_SERIES | recorded_series()
    for group in rules["groups"]:
        for rule in group["rules"]:
            unknown = series_in(rule["expr"]) - known
            assert not unknown, f"{rule.get('record') or rule['alert']} reads {unknown}"
    names = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    assert len(names) == len(set(names))


def test_acceptance_rules_are_the_documented_formulas():
    rules = {r["record"]: " ".join(r["expr"].split()) for g in yaml.safe_load(
        (PROMETHEUS / "rules.yml").read_text())["groups"] for r in g["rules"] if "record" in r}
    assert rules["rhymerl:spec_decode_acceptance_rate:rate1m"] == (
        "sum(rate(rhymerl:spec_decode_num_accepted_tokens_total[1m])) "
        "/ sum(rate(rhymerl:spec_decode_num_draft_tokens_total[1m]))")
    assert rules["rhymerl:spec_decode_mean_acceptance_length:rate1m"] == (
        "1 + sum(rate(rhymerl:spec_decode_num_accepted_tokens_total[1m])) "
        "/ sum(rate(rhymerl:spec_decode_num_drafts_total[1m]))")


def test_prometheus_scrapes_every_service_on_its_metrics_port():
    """The compose scrape targets are the services' default RHYMERL_*_METRICS_PORT."""
    from services.history.settings import HistorySettings
    from services.rollout.settings import WorkerSettings
    from services.scheduler.settings import SchedulerSettings

    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["history"]["static_configs"][0]["targets"] == [
        f"history:{HistorySettings.model_fields['metrics_port'].default}"]
    assert jobs["scheduler"]["static_configs"][0]["targets"] == [
        f"scheduler:{SchedulerSettings.model_fields['metrics_port'].default}"]
    assert jobs["worker"]["dns_sd_configs"][0]["port"] == WorkerSettings.model_fields["metrics_port"].default
    assert config["rule_files"] == ["rules.yml"]


# Defaults of the monitoring stack a service runs beside (the router's metrics port was
# once 9090: next to a Prometheus it could not start, or answered its scrapes). Not
# Pushgateway's 9091: the scheduler's metrics port since its first release (this stack
# has no Pushgateway).
MONITORING_PORTS = {9090: "Prometheus", 9093: "Alertmanager", 9094: "Alertmanager (cluster)", 3000: "Grafana"}


def test_no_default_port_is_another_services_or_the_monitoring_stacks():
    """Every service's default ports are distinct (one machine runs them all: `make run`,
    docker-compose) and none is Prometheus's, Alertmanager's or Grafana's."""
    from services.history.settings import HistorySettings
    from services.rollout.settings import WorkerSettings
    from services.router.settings import RouterSettings
    from services.scheduler.settings import SchedulerSettings

    ports: dict[int, str] = {}
    for cls in (HistorySettings, SchedulerSettings, RouterSettings, WorkerSettings):
        for name, field in cls.model_fields.items():
            if name.endswith("port") and field.default:
                where = f"{cls.__name__}.{name}"
                assert field.default not in ports, f"{where} and {ports[field.default]} both default to {field.default}"
                assert field.default not in MONITORING_PORTS, \
                    f"{where} defaults to {field.default}, {MONITORING_PORTS[field.default]}'s port"
                ports[field.default] = where
    assert len(ports) >= 9  # the four gRPC and metrics ports and the scheduler's health port at least


# --- Grafana ----------------------------------------------------------------------------

def test_committed_dashboard_is_what_the_generator_writes():
    """Someone edited the JSON by hand or changed the generator without regenerating."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_dashboards", GRAFANA / "generate_dashboards.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    assert generator.OUT.read_text() == generator.render(), \
        "run: python deploy/grafana/generate_dashboards.py"


def test_every_dashboard_query_parses(tmp_path):
    queries = dashboard_queries()
    assert len(queries) >= 20
    proc = promtool_check_exprs([substitute(e) for _, _, e in queries], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_promtool_parse_check_catches_a_bad_query(tmp_path):
    """The parse check above is worth something: a broken query fails it."""
    assert promtool_check_exprs(["sum(rate(rhymerl:generation_tokens_total[1m])"], tmp_path).returncode != 0


def test_dashboards_name_only_exported_or_recorded_series():
    known = exported_series() | SCRAPE_SERIES | recorded_series()
    for board, title, expr in dashboard_queries():
        unknown = series_in(substitute(expr)) - known
        assert not unknown, f"{board} / {title}: {unknown}"


def test_series_extraction():
    assert series_in('sum by (worker) (rate(a:b_total{worker=~"x|y"}[1m])) / scalar(c)') == {"a:b_total", "c"}
    assert series_in("1 + histogram_quantile(0.5, sum by (le) (rate(h_bucket[5m])))") == {"h_bucket"}


def test_dashboards_cover_the_questions_operators_ask():
    """Acceptance, lengths, per-position, bubbles, tails, makespan, tokens/s, queue, health,
    weight version, KV cache, history hit rate: each has a panel reading its series."""
    read = set().union(*(series_in(substitute(e)) for _, _, e in dashboard_queries()))
    for series in ["rhymerl:spec_decode_acceptance_rate:rate1m", "rhymerl:spec_decode_mean_acceptance_length:rate1m",
                   "rhymerl:spec_decode_acceptance_rate_by_position:rate1m", "rhymerl:step_bubble_ratio",
                   "rhymerl:step_tail_seconds", "rhymerl:step_makespan_seconds",
                   "rhymerl:generation_tokens_by_worker:rate1m", "rhymerl:queue_depth", "rhymerl:workers_registered",
                   "up", "rhymerl:weight_version", "rhymerl:kv_cache_usage_perc", "rhymerl:history_hit_ratio:rate5m"]:
        assert series in read, series


def test_dashboard_layout_and_datasource():
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] and board["title"]
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), "duplicate panel ids"
        for panel in board["panels"]:
            assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                refs = [t["refId"] for t in panel["targets"]]
                assert len(refs) == len(set(refs)) and all(refs)
        variables = {v["name"]: v for v in board["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource"


def test_grafana_provisioning_points_at_the_dashboards():
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "rhymerl.yml").read_text())
    dashboard_dir = providers["providers"][0]["options"]["path"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{dashboard_dir}:ro" in mounts
    assert "./deploy/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
    home = compose["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (GRAFANA / "dashboards" / Path(home).name).exists() and home.startswith(dashboard_dir)
