"""A picture of a Grafana dashboard with a real run's data, without a Grafana server.

    .venv/bin/python deploy/grafana/snapshot.py --dashboard deploy/grafana/dashboards/rhymerl-overview.json \\
        --out docs/dashboard.png [--steps 4]

It starts the whole local system (services.local.LocalCluster: history with its
redis-server, the scheduler, CPU workers serving models/tiny, trained first if missing)
and a real Prometheus (Debian's /usr/bin/prometheus, through
tests/deploy/prometheus_server.py) that scrapes every process and evaluates
deploy/prometheus/rules.yml, runs a short GRPO loop through the SDK
(clients/python/examples/grpo_trainer.py), waits for a few scrapes after its end, and
then, for every panel of the dashboard JSON, runs the panel's own PromQL targets
(Grafana's template variables substituted as Grafana would) over the run's time range
with Prometheus's query_range API and draws the result with matplotlib in the panels'
grid layout: timeseries as lines (legends from each target's legendFormat), stat panels
as their last value. It is not Grafana and says so in a corner of the image.

`render()` is the drawing half alone: it takes the query function as an argument, so it
runs on canned data too (tests/deploy/test_snapshot.py).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: services/ and tests/ import from the repo root
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

NOTE = "rendered by deploy/grafana/snapshot.py from a real run's Prometheus data (not Grafana)"

# Grafana's dark theme and its classic series palette.
BG, PANEL_BG, BORDER, TEXT, MUTED, GRID = "#111217", "#181b1f", "#2c3235", "#ccccdc", "#8e8e98", "#262a2f"
GREEN, RED = "#73bf69", "#f2495c"
PALETTE = ["#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a6", "#705da0",
           "#508642", "#cca300", "#447ebc", "#c15c17"]
# Grafana's layout: 24 columns, grid rows of 30 px; a 1920 px wide dashboard.
COLUMNS, COLUMN_PX, ROW_PX, HEADER_PX, FOOTER_PX, DPI = 24, 80, 30, 70, 34, 100

# query_range(expr, start, end, step) -> Prometheus's "matrix" result:
# [{"metric": {label: value}, "values": [[unix_ts, "value"], ...]}, ...]
Fetch = Callable[[str, float, float, float], list[dict]]


# --- the dashboard JSON ---------------------------------------------------------------------

def load_dashboard(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def panels(board: dict) -> list[dict]:
    """Every panel, rows included, with the panels of collapsed rows after their row."""
    found = []
    for panel in board["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return found


def variables(step_s: float, range_s: float, scrape_s: float) -> dict[str, str]:
    """Grafana's values of the dashboard's variables for a query_range step of `step_s`.

    $__rate_interval is Grafana's max($__interval + scrape interval, 4 x scrape interval);
    $worker (multi-value, include All) is All, i.e. its allValue `.*`."""
    def duration(s: float) -> str:
        return f"{max(1, math.ceil(s))}s"

    return {"$__rate_interval": duration(max(step_s + scrape_s, 4 * scrape_s)),
            "$__interval": duration(step_s), "$__range": duration(range_s),
            "${worker:regex}": ".*", "${worker}": ".*", "$worker": ".*"}


def substitute(expr: str, values: dict[str, str]) -> str:
    for variable, value in values.items():
        expr = expr.replace(variable, value)
    if "$" in expr:
        raise ValueError(f"unknown Grafana variable in {expr}")
    return expr


def legend(target: dict, metric: dict[str, str], expr: str) -> str:
    """A series' name as Grafana shows it: the legendFormat with {{label}} filled in, else
    the series' labels, else the query."""
    fmt = target.get("legendFormat")
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)
    labels = {k: v for k, v in metric.items() if k != "__name__"}
    if not labels:
        return metric.get("__name__", expr)
    inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{metric.get('__name__', '')}{{{inner}}}"


# --- units -----------------------------------------------------------------------------------

def format_value(value: float, unit: str | None) -> str:
    if value is None or math.isnan(value):
        return "No data"
    if unit == "percentunit":
        return f"{100 * value:.1f}%"
    if unit == "s":
        if value == 0:
            return "0 s"
        if abs(value) < 1:
            return f"{1000 * value:.3g} ms"
        return f"{value:.3g} s" if abs(value) < 60 else f"{value / 60:.3g} min"
    suffix = {"reqps": " req/s"}.get(unit or "", "")
    if value == int(value) and abs(value) < 1e6:
        return f"{int(value)}{suffix}"
    for scale, letter in ((1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{letter}{suffix}"
    return f"{value:.3g}{suffix}"


def axis_formatter(unit: str | None) -> FuncFormatter:
    def fmt(value: float, _pos) -> str:
        if unit == "percentunit":
            return f"{100 * value:.4g}%"  # 2.5%, 10%, 100%
        if unit == "s":
            return format_value(value, unit)
        return format_value(value, unit if unit == "reqps" else None).replace(" req/s", "")
    return FuncFormatter(fmt)


# --- drawing ---------------------------------------------------------------------------------

def series_of(panel: dict, fetch: Fetch, start: float, end: float, step: float,
              values: dict[str, str]) -> list[tuple[str, list[float], list[float]]]:
    """(legend, unix timestamps, values) of every series of every target of `panel`."""
    out = []
    for target in panel.get("targets", []):
        if target.get("hide") or not target.get("expr"):
            continue
        expr = substitute(target["expr"], values)
        for row in fetch(expr, start, end, step):
            ts = [float(t) for t, _ in row["values"]]
            vs = [float(v) for _, v in row["values"]]  # "NaN", "+Inf" parse as floats
            out.append((legend(target, row["metric"], expr), ts, vs))
    return out


def panel_box(fig, grid: dict, total_rows: int) -> tuple[float, float, float, float]:
    """A gridPos as a figure-fraction rectangle (left, bottom, width, height), with a gutter."""
    width_px, height_px = fig.get_size_inches() * DPI
    gutter = 4
    left = grid["x"] * COLUMN_PX + gutter
    top = HEADER_PX + grid["y"] * ROW_PX + gutter
    w, h = grid["w"] * COLUMN_PX - 2 * gutter, grid["h"] * ROW_PX - 2 * gutter
    return left / width_px, 1 - (top + h) / height_px, w / width_px, h / height_px


def draw_frame(fig, box, title: str) -> None:
    left, bottom, w, h = box
    fig.patches.append(FancyBboxPatch((left, bottom), w, h, boxstyle="round,pad=0,rounding_size=0.002",
                                      transform=fig.transFigure, facecolor=PANEL_BG, edgecolor=BORDER,
                                      linewidth=0.8, zorder=-1))  # under the axes
    fig.text(left + 0.006 * 24 / COLUMNS, bottom + h - 0.004, title, color=TEXT, fontsize=10.5,
             fontweight="bold", va="top", ha="left")


def inner_axes(fig, box, title_px: float = 26, pad_px: float = 8):
    width_px, height_px = fig.get_size_inches() * DPI
    left, bottom, w, h = box
    ax = fig.add_axes([left + pad_px / width_px, bottom + pad_px / height_px,
                       w - 2 * pad_px / width_px, h - (title_px + pad_px) / height_px])
    ax.set_facecolor(PANEL_BG)
    return ax


def no_data(ax) -> None:
    ax.set_axis_off()
    ax.text(0.5, 0.5, "No data", color=MUTED, fontsize=13, ha="center", va="center", transform=ax.transAxes)


def last_value(vs: list[float]) -> float:
    """Grafana's lastNotNull."""
    for v in reversed(vs):
        if not math.isnan(v):
            return v
    return math.nan


def threshold_color(panel: dict, value: float) -> str:
    """The colour of the value under the panel's thresholds (Grafana's default: green, red from 80)."""
    thresholds = panel.get("fieldConfig", {}).get("defaults", {}).get("thresholds") or {
        "steps": [{"color": "green", "value": None}, {"color": "red", "value": 80}]}
    color = "green"
    for step in thresholds.get("steps", []):
        if step.get("value") is None or value >= step["value"]:
            color = step["color"]
    return {"green": GREEN, "red": RED, "yellow": "#fade2a", "orange": "#ff9830", "blue": "#5794f2"}.get(color, color)


def draw_stat(fig, box, panel: dict, series, unit: str | None) -> None:
    ax = inner_axes(fig, box)
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    if not series:
        return no_data(ax)
    legend_, ts, vs = series[0]  # one series per stat panel here; Grafana would tile more
    value = last_value(vs)
    color = threshold_color(panel, value) if not math.isnan(value) else MUTED
    if panel.get("options", {}).get("graphMode") == "area" and len(ts) > 1:
        spark = fig.add_axes(ax.get_position().bounds, zorder=0)
        spark.set_axis_off()
        spark.fill_between(ts, vs, color=color, alpha=0.18, linewidth=0)
        spark.plot(ts, vs, color=color, alpha=0.6, linewidth=1)
        finite = [v for v in vs if not math.isnan(v)]
        if finite:
            lo, hi = min(finite), max(finite)
            spark.set_ylim(lo - 0.05 * (hi - lo or 1), hi + 2.0 * (hi - lo or 1))
        spark.set_xlim(ts[0], ts[-1])
    ax.set_zorder(1)
    ax.text(0.5, 0.5, format_value(value, unit), color=color, fontsize=30, fontweight="bold",
            ha="center", va="center")
    if len(series) > 1:
        ax.text(0.98, 0.02, f"+{len(series) - 1} series", color=MUTED, fontsize=7, ha="right", va="bottom")


def field_config(panel: dict, name: str) -> dict:
    """The panel's field defaults for the series `name`, with its byName/byRegexp overrides
    applied (e.g. {"unit": "s", "custom": {"axisPlacement": "right"}})."""
    fc = panel.get("fieldConfig", {})
    config = {**fc.get("defaults", {})}
    config["custom"] = dict(config.get("custom", {}))
    for override in fc.get("overrides", []):
        matcher = override.get("matcher", {})
        kind, option = matcher.get("id"), matcher.get("options", "")
        if (kind == "byName" and option == name) or (kind == "byRegexp" and re.fullmatch(option, name)):
            for prop in override.get("properties", []):
                key = prop["id"]
                if key.startswith("custom."):
                    config["custom"][key.removeprefix("custom.")] = prop.get("value")
                else:
                    config[key] = prop.get("value")
    return config


def style_y_axis(ax, values: list[float], unit: str | None, lo: float | None, hi: float | None) -> None:
    """Grafana's y axis: the field's min/max where set, else from 0 (non-negative data) to the top."""
    finite = [v for v in values if math.isfinite(v)]
    if lo is None and finite and min(finite) >= 0:
        lo = 0.0
    if hi is None and finite and lo is not None:
        hi = max(finite) * 1.08 if max(finite) > lo else lo + 1
    ax.set_ylim(bottom=lo, top=hi)
    ax.yaxis.set_major_formatter(axis_formatter(unit))
    ax.yaxis.set_major_locator(plt.MaxNLocator(5))
    ax.tick_params(colors=MUTED, labelsize=7.5, length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)


def draw_timeseries(fig, box, panel: dict, series, unit: str | None, start: float, end: float) -> None:
    ax = inner_axes(fig, box)
    if not series:
        return no_data(ax)
    right = None  # a second y axis for series the overrides place on the right
    handles, axes_values = [], {"left": [], "right": []}
    right_unit = right_lo = right_hi = None
    for i, (name, ts, vs) in enumerate(series):
        config = field_config(panel, name)
        custom = config["custom"]
        side = "right" if custom.get("axisPlacement") == "right" else "left"
        if side == "right":
            right = right or ax.twinx()
            right_unit, right_lo, right_hi = config.get("unit"), config.get("min"), config.get("max")
        target = right if side == "right" else ax
        color = PALETTE[i % len(PALETTE)]
        when = [datetime.fromtimestamp(t, timezone.utc) for t in ts]
        (line,) = target.plot(when, vs, color=color, linewidth=custom.get("lineWidth", 1) + 0.3, label=name)
        handles.append(line)
        fill = custom.get("fillOpacity", 0) / 100
        if fill:
            target.fill_between(when, vs, color=color, alpha=fill, linewidth=0)
        axes_values[side].extend(vs)
    ax.set_xlim(datetime.fromtimestamp(start, timezone.utc), datetime.fromtimestamp(end, timezone.utc))
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    style_y_axis(ax, axes_values["left"], unit, defaults.get("min"), defaults.get("max"))
    if right is not None:
        style_y_axis(right, axes_values["right"], right_unit, right_lo, right_hi)
    if not any(math.isfinite(v) for _, _, vs in series for v in vs):
        ax.text(0.5, 0.5, "No data (every point NaN)", color=MUTED, fontsize=11, ha="center", va="center",
                transform=ax.transAxes)
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S", tz=timezone.utc))
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(minticks=3, maxticks=7))
    ax.grid(True, color=GRID, linewidth=0.6)
    # A bottom legend as Grafana's, read row by row, under the time axis's labels.
    width_px, height_px = fig.get_size_inches() * DPI
    ncol = 4 if len(series) <= 8 else 6
    rows = math.ceil(len(series) / ncol)
    axis_px, legend_px = 16, 6 + 13 * rows
    left, bottom, w, h = ax.get_position().bounds
    room = (axis_px + legend_px) / height_px
    right_px = 40 if right is not None else 0
    position = [left + 36 / width_px, bottom + room, w - (36 + right_px) / width_px, h - room]
    for axis in (ax, right):
        if axis is not None:
            axis.set_position(position)
    order = [i for c in range(ncol) for i in range(c, len(handles), ncol)]  # matplotlib fills columns first
    ax.legend([handles[i] for i in order], [handles[i].get_label() for i in order], loc="upper left",
              ncol=ncol, bbox_to_anchor=(left, bottom + legend_px / height_px), bbox_transform=fig.transFigure,
              frameon=False, fontsize=7.5, labelcolor=TEXT, handlelength=1.2, columnspacing=1.2,
              borderaxespad=0, borderpad=0, labelspacing=0.25)


def render(board: dict, fetch: Fetch, start: float, end: float, out: str | Path, *, scrape_s: float = 15.0,
           subtitle: str = "", max_points: int = 300) -> list[str]:
    """Draws every panel of `board` with the data `fetch` returns for its targets over
    [start, end]; writes the PNG to `out`; returns the titles of the panels drawn, in order."""
    step = max(1.0, math.ceil((end - start) / max_points))
    values = variables(step, end - start, scrape_s)
    all_panels = panels(board)
    grid_rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in all_panels)
    width_px, height_px = COLUMNS * COLUMN_PX, HEADER_PX + grid_rows * ROW_PX + FOOTER_PX
    fig = plt.figure(figsize=(width_px / DPI, height_px / DPI), dpi=DPI, facecolor=BG)
    fig.text(12 / width_px, 1 - 14 / height_px, board.get("title", "dashboard"), color=TEXT, fontsize=17,
             fontweight="bold", va="top")
    utc = lambda t: datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")  # noqa: E731
    range_text = f"{utc(start)} to {utc(end)} UTC  ·  worker: All  ·  step {step:g} s  ·  " \
                 f"$__rate_interval {values['$__rate_interval']}"
    fig.text(12 / width_px, 1 - 44 / height_px, range_text + (f"  ·  {subtitle}" if subtitle else ""),
             color=MUTED, fontsize=9, va="top")
    fig.text(1 - 12 / width_px, 1 - 16 / height_px, NOTE, color="#ffb357", fontsize=10, va="top", ha="right",
             fontweight="bold", bbox={"facecolor": "#2a2116", "edgecolor": "#ff9830", "boxstyle": "round,pad=0.4"})
    fig.text(1 - 12 / width_px, 10 / height_px, NOTE, color=MUTED, fontsize=8, va="bottom", ha="right")

    drawn = []
    for panel in all_panels:
        grid, title, kind = panel["gridPos"], panel.get("title", ""), panel.get("type")
        if kind == "row":
            fig.text((grid["x"] * COLUMN_PX + 6) / width_px, 1 - (HEADER_PX + grid["y"] * ROW_PX + 6) / height_px,
                     title, color=TEXT, fontsize=12.5, fontweight="bold", va="top")
            drawn.append(title)
            continue
        box = panel_box(fig, grid, grid_rows)
        draw_frame(fig, box, title)
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        series = series_of(panel, fetch, start, end, step, values)
        if kind == "stat":
            draw_stat(fig, box, panel, series, unit)
        elif kind == "timeseries":
            draw_timeseries(fig, box, panel, series, unit, start, end)
        else:
            ax = inner_axes(fig, box)
            ax.set_axis_off()
            ax.text(0.5, 0.5, f"panel type {kind!r}: not drawn by snapshot.py", color=MUTED, ha="center",
                    transform=ax.transAxes)
        drawn.append(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI, facecolor=BG)
    plt.close(fig)
    shrink_png(out)
    return drawn


def shrink_png(path: Path, colors: int = 128) -> None:
    """Re-saves the PNG with an adaptive palette (a few hundred KB -> well under): flat dark
    panels and thin lines lose nothing visible."""
    try:
        from PIL import Image
    except ImportError:  # matplotlib depends on Pillow; keep the full-colour PNG if it is missing
        return
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)


# --- the real run ----------------------------------------------------------------------------

def prometheus_fetch(prom) -> Fetch:
    """query_range against the running Prometheus (tests/deploy/prometheus_server.py)."""
    def fetch(expr: str, start: float, end: float, step: float) -> list[dict]:
        data = prom.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step:g}")
        return data["result"]
    return fetch


def real_run(args) -> list[str]:
    from rhymerl import RolloutClient

    from benchmarks.tiny_llm.checkpoint import ensure_model
    from benchmarks.tiny_llm.examples import load_example
    from services.local import LocalCluster
    from tests.deploy.prometheus_server import BINARY, PrometheusServer

    if not BINARY.exists():
        sys.exit(f"{BINARY} missing: `make install` installs Debian's prometheus")
    model_dir = str(Path(args.model_dir).resolve())
    ensure_model(model_dir)
    board = load_dashboard(args.dashboard)
    with tempfile.TemporaryDirectory(prefix="rhymerl-snapshot-") as tmp:
        tmp = Path(tmp)
        cluster = LocalCluster(model_dir=model_dir, num_workers=args.workers, policy=args.policy,
                               log_dir=tmp / "logs")
        prom = None
        try:
            print(f"starting history, scheduler and {args.workers} CPU workers ({model_dir})...", flush=True)
            cluster.start()
            workers = [f"worker-{i}" for i in range(args.workers)]
            # The job and component labels of deploy/prometheus/prometheus.yml, on the local ports.
            jobs = {
                "history": ([f"127.0.0.1:{cluster.metrics_ports['history']}"], {"component": "history"}),
                "scheduler": ([f"127.0.0.1:{cluster.metrics_ports['scheduler']}"], {"component": "scheduler"}),
                "worker": ([f"127.0.0.1:{cluster.metrics_ports[w]}" for w in workers], {"component": "worker"}),
            }
            prom = PrometheusServer(tmp / "prometheus", jobs=jobs, interval_s=args.scrape_interval,
                                    rules_file=ROOT / "deploy" / "prometheus" / "rules.yml").start()
            print(f"prometheus on {prom.url}, scraping every {args.scrape_interval} s", flush=True)
            prom.wait_for(lambda: prom.value('sum(up{component=~"history|scheduler|worker"})') == 2 + args.workers,
                          "all targets up")
            start = time.time() - args.scrape_interval
            time.sleep(3 * args.scrape_interval)  # an idle stretch before the first step
            trainer = load_example("grpo_trainer")
            with RolloutClient(cluster.scheduler_address, timeout_s=600) as client:
                trainer.run(client, model_dir, steps=args.steps, num_prompts=args.prompts, n=args.n,
                            max_tokens=args.max_tokens, partial_credit=0.5, log=lambda line: print(line, flush=True))
            # The scheduler's last step scraped, then a few more scrapes and rule evaluations.
            prom.wait_for(lambda: prom.value('sum(rhymerl:steps_total{status="finished"})') == args.steps,
                          "the scheduler's last step")
            time.sleep(3 * args.scrape_interval + 1)
            end = time.time()
            fetch = prometheus_fetch(prom)
            subtitle = (f"{args.steps} GRPO steps x {args.prompts} prompts x {args.n} samples, "
                        f"{args.workers} CPU workers, models/tiny, scrape {args.scrape_interval} s")
            drawn = render(board, fetch, start, end, args.out, scrape_s=args.scrape_interval, subtitle=subtitle)
        finally:
            if prom is not None:
                prom.stop()
            cluster.stop()
    return drawn


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dashboard", default=str(ROOT / "deploy/grafana/dashboards/rhymerl-overview.json"))
    parser.add_argument("--out", default=str(ROOT / "docs/dashboard.png"))
    parser.add_argument("--steps", type=int, default=16, help="GRPO steps")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2, help="CPU rollout workers")
    parser.add_argument("--policy", default="rhymerl", help="the scheduler's placement policy")
    parser.add_argument("--scrape-interval", type=int, default=1, help="seconds between scrapes/rule evaluations")
    parser.add_argument("--model-dir", default=str(ROOT / "models/tiny"), help="trained here if missing")
    args = parser.parse_args(argv)
    drawn = real_run(args)
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out} ({size // 1024} KB): {len(drawn)} panels", flush=True)


if __name__ == "__main__":
    main()
