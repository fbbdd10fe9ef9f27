"""deploy/grafana/snapshot.py draws every panel of the committed dashboards, from canned
query_range results (no Prometheus, no cluster: the real run is `snapshot.py` itself)."""

from __future__ import annotations

import importlib.util
import math
import re

import pytest

from tests.deploy.test_observability import DASHBOARDS, GRAFANA

spec = importlib.util.spec_from_file_location("grafana_snapshot", GRAFANA / "snapshot.py")
snapshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(snapshot)

START, END = 1_700_000_000.0, 1_700_000_180.0


def canned(queries: list[str]):
    """A fake query_range: two workers' series for `by (worker)` queries, one series
    otherwise, nothing for the migrations query (so a 'No data' path is drawn too)."""
    def fetch(expr: str, start: float, end: float, step: float) -> list[dict]:
        queries.append(expr)
        assert "$" not in expr and start == START and end == END and step >= 1
        if "migrations" in expr or expr.startswith("sum(rhymerl:workers_registered{healthy=\"false\"})"):
            return []
        times = [start + i * step for i in range(int((end - start) // step) + 1)]
        labelled = re.search(r"by \(([a-z_]+)", expr) or re.search(r"_by_([a-z]+)", expr)
        labels = [{labelled.group(1): f"v{i}"} for i in range(2)] if labelled else [{}]
        return [{"metric": metric, "values": [[t, str(0.5 + 0.4 * math.sin(t / 20 + i)) if j % 17 else "NaN"]
                                               for j, t in enumerate(times)]}
                for i, metric in enumerate(labels)]
    return fetch


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_panel_is_drawn_from_its_queries(path, tmp_path):
    board = snapshot.load_dashboard(path)
    queries: list[str] = []
    out = tmp_path / "dashboard.png"
    drawn = snapshot.render(board, canned(queries), START, END, out, scrape_s=1, subtitle="canned data")
    assert drawn == [p["title"] for p in snapshot.panels(board)]
    targets = [t for p in snapshot.panels(board) for t in p.get("targets", []) if t.get("expr")]
    assert len(queries) == len(targets)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert 20_000 < out.stat().st_size < 600_000


def test_grafana_variables_and_legends():
    values = snapshot.variables(step_s=2, range_s=180, scrape_s=1)
    assert values["$__rate_interval"] == "4s"  # max(step + scrape, 4 x scrape)
    assert snapshot.substitute('rate(x{worker=~"$worker"}[$__rate_interval])', values) == 'rate(x{worker=~".*"}[4s])'
    with pytest.raises(ValueError):
        snapshot.substitute("x[$unknown]", values)
    assert snapshot.legend({"legendFormat": "p50 {{kind}}"}, {"kind": "decode"}, "e") == "p50 decode"
    assert snapshot.legend({}, {"__name__": "up", "job": "a"}, "e") == 'up{job="a"}'
    assert snapshot.legend({}, {}, "sum(up)") == "sum(up)"
    assert snapshot.format_value(0.256, "percentunit") == "25.6%"
    assert snapshot.format_value(math.nan, "s") == "No data"
