"""A real Prometheus (Debian's /usr/bin/prometheus) for tests: scrapes given targets,
evaluates rhymerl's recording rules, and answers PromQL over its HTTP API.

Used by test_observability_e2e.py; stdlib only (urllib + json).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import yaml

from services.common.redis_server import free_port

BINARY = Path("/usr/bin/prometheus")


class PromQLError(RuntimeError):
    """The HTTP API answered status "error" (e.g. errorType bad_data for a query that does not parse)."""

    def __init__(self, error_type: str, error: str):
        super().__init__(f"{error_type}: {error}")
        self.error_type = error_type


@dataclass
class PrometheusServer:
    """Prometheus scraping `jobs` (job name -> (targets, labels)) every `interval_s`, with
    `rules_file`'s groups evaluated every `interval_s` too (their own `interval:` is overridden,
    so a recording rule exists seconds after its inputs do, not after the production 15 s)."""

    workdir: Path
    jobs: dict[str, tuple[list[str], dict[str, str]]]
    rules_file: Path | None = None
    interval_s: int = 1
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path = field(init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        interval = f"{self.interval_s}s"
        config: dict = {
            "global": {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval},
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": targets, "labels": labels}]}
                for job, (targets, labels) in self.jobs.items()],
        }
        if self.rules_file is not None:
            rules = yaml.safe_load(self.rules_file.read_text())
            for group in rules["groups"]:
                group["interval"] = interval
            (self.workdir / "rules.yml").write_text(yaml.safe_dump(rules, sort_keys=False))
            config["rule_files"] = ["rules.yml"]
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def start(self, timeout_s: float = 60.0) -> Self:
        self.port = self.port or free_port()
        self.jobs.setdefault("prometheus", ([f"127.0.0.1:{self.port}"], {}))
        config = self.write_config()
        self.log_path = self.workdir / "prometheus.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [str(BINARY), f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus not ready after {timeout_s} s:\n{self.tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def tail(self, lines: int = 30) -> str:
        path = getattr(self, "log_path", None)
        return "\n".join(path.read_text().splitlines()[-lines:]) if path and path.exists() else ""

    # --- HTTP API ---------------------------------------------------------------------
    def api(self, endpoint: str, **params) -> object:
        """GET /api/v1/<endpoint>; returns `data`, raises PromQLError on status "error"."""
        url = f"{self.url}/api/v1/{endpoint}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as err:  # 400 bad_data, 422 execution, ...: the body says why
            body = json.loads(err.read())
        if body["status"] != "success":
            raise PromQLError(body.get("errorType", "?"), body.get("error", "?"))
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant query; a list of {"metric": labels, "value": [ts, "v"]} (scalars as one row)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self.api("query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def value(self, expr: str, at: float | None = None) -> float | None:
        """The single value of `expr`, or None when it has no result."""
        rows = self.query(expr, at)
        if not rows:
            return None
        assert len(rows) == 1, f"{expr} has {len(rows)} series: {rows}"
        return float(rows[0]["value"][1])

    def metric_names(self) -> set[str]:
        return set(self.api("label/__name__/values"))

    def rule_groups(self) -> list[dict]:
        return self.api("rules")["groups"]

    def wait_for(self, predicate, what: str, timeout_s: float = 30.0, poll_s: float = 0.25):
        """Polls `predicate()` until it returns a truthy value, which it returns."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus: {what} not within {timeout_s} s")
            time.sleep(poll_s)
