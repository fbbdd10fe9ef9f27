"""Every Prometheus metric rhymerl exports, in one place.

Names follow vLLM where vLLM measures the same quantity (``vllm:spec_decode_*``
becomes ``rhymerl:spec_decode_*``); the rest are ours. Each process imports only
what it updates; a metric that a process never touches is still registered (at
zero), which keeps dashboards and recording rules valid on every target.
"""

import errno
import itertools
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

NS = "rhymerl:"


class BulkHistogram(Collector):
    """A Prometheus histogram observed an array at a time (a step's tokens at once, where
    a ``Histogram.observe`` call per value would cost seconds); exported like any other.
    numpy is imported by the first ``observe_many``: a process that never observes one
    (a scheduler no trainer reports logprobs to) does not load it (~12 MB)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets]  # upper bounds, +Inf implied
        self._counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative
        self._sum = 0.0
        self._lock = threading.Lock()
        REGISTRY.register(self)

    def observe_many(self, values) -> None:
        import numpy as np

        values = np.asarray(values, dtype=np.float64).ravel()
        counts = np.bincount(np.searchsorted(self.bounds, values, side="left"), minlength=len(self._counts))
        with self._lock:
            self._counts = [total + int(c) for total, c in zip(self._counts, counts)]
            self._sum += float(values.sum())

    def collect(self):
        with self._lock:
            cumulative, total = list(itertools.accumulate(self._counts)), self._sum
        family = HistogramMetricFamily(self.name, self.documentation)
        bounds = [repr(b) for b in self.bounds] + ["+Inf"]
        family.add_metric([], list(zip(bounds, cumulative)), total)
        yield family

# --- speculative decoding (rollout workers) -----------------------------------
spec_num_drafts = Counter(NS + "spec_decode_num_drafts", "Verify steps that carried a draft", ["worker"])
spec_num_draft_tokens = Counter(NS + "spec_decode_num_draft_tokens", "Draft tokens proposed", ["worker"])
spec_num_accepted_tokens = Counter(NS + "spec_decode_num_accepted_tokens", "Draft tokens accepted", ["worker"])
spec_num_accepted_tokens_per_pos = Counter(
    NS + "spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position in the draft",
    ["worker", "position"])
drafter_misses = Counter(NS + "drafter_no_match", "Decoding sequences that got no draft in a step", ["worker"])
drafter_errors = Counter(NS + "drafter_errors", "Drafter calls that raised (the request decodes undrafted)",
                         ["worker"])
drafter_feed_responses = Counter(NS + "drafter_feed_responses", "Responses the drafter's global index took "
                                 "(finished samples and the history service's stream)", ["worker"])
drafter_feed_pending = Gauge(NS + "drafter_feed_pending_responses", "Responses handed to the drafter's global index "
                             "and not in it yet (paced behind the engine's forwards)", ["worker"])
tree_drafts = Counter(NS + "spec_tree_drafts", "Draft trees verified (drafts with a branch), by batch-size bucket",
                      ["worker", "batch"])
tree_nodes = Counter(NS + "spec_tree_nodes", "Nodes of the verified draft trees, by batch-size bucket",
                     ["worker", "batch"])
tree_accepted = Counter(NS + "spec_tree_accepted_tokens", "Tokens accepted from draft trees, by batch-size bucket",
                        ["worker", "batch"])
tree_width = Histogram(NS + "spec_tree_width", "Most nodes at one depth of a draft tree", ["worker"],
                       buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32))
tree_depth = Histogram(NS + "spec_tree_depth", "Deepest node of a draft tree", ["worker"],
                       buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32))

# --- engine (rollout workers) ---------------------------------------------------
generation_tokens = Counter(NS + "generation_tokens", "Tokens generated", ["worker"])
prompt_tokens = Counter(NS + "prompt_tokens", "Prompt tokens prefilled (including re-prefills)", ["worker"])
num_requests_running = Gauge(NS + "num_requests_running", "Sequences in the running batch", ["worker"])
num_requests_waiting = Gauge(NS + "num_requests_waiting", "Sequences waiting for the engine", ["worker"])
kv_cache_usage = Gauge(NS + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use", ["worker"])
engine_step_seconds = Histogram(
    NS + "engine_step_seconds", "Time of one engine step (forward + sampling)", ["worker", "kind"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5))
engine_forwards = Counter(NS + "engine_forwards", "Engine forwards, by how they ran: 'graph' (a CUDA graph "
                          "replayed) or 'eager' (prefills longer than a verify, steps past the largest graph, the CPU)",
                          ["worker", "mode"])
gc_pause_seconds = Histogram(
    NS + "gc_pause_seconds", "Pauses of a worker's garbage collector, by where they ran: 'forward' (behind a step's "
    "forward, RHYMERL_WORKER_GC_THRESHOLDS), 'elsewhere' (automatic: in a step's host work or while idle)",
    ["worker", "where"], buckets=(1e-5, 1e-4, 5e-4, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1))
worker_busy_seconds = Counter(NS + "worker_busy_seconds", "Seconds the engine had work", ["worker"])
worker_idle_seconds = Counter(NS + "worker_idle_seconds", "Seconds the engine had no work", ["worker"])
weight_version = Gauge(NS + "weight_version", "Policy version being served", ["component"])
weight_update_seconds = Histogram(NS + "weight_update_seconds", "Time to apply a weight update", ["component"])
weight_pushes_in_progress = Gauge(NS + "weight_pushes_in_progress", "Weight pushes being received (a worker) or "
                                  "fanned out (the scheduler), from their header to their answer", ["component"])

# --- scheduler --------------------------------------------------------------------
steps_total = Counter(NS + "steps", "Steps submitted", ["status"])
steps_abandoned_total = Counter(NS + "steps_abandoned", "Steps cancelled because no trainer followed them for "
                                "abandoned_step_timeout_s (also counted as cancelled in steps_total)")
samples_total = Counter(NS + "samples", "Samples returned", ["finish_reason"])
queue_depth = Gauge(NS + "queue_depth", "Requests waiting for a worker")
step_makespan_seconds = Gauge(NS + "step_makespan_seconds", "Makespan of the last finished step")
step_bubble_ratio = Gauge(NS + "step_bubble_ratio", "Idle worker-seconds / worker-seconds of the last step")
step_tail_seconds = Gauge(NS + "step_tail_seconds", "Time to finish the last 10% of the last step's samples")
step_makespan_hist = Histogram(
    NS + "step_makespan_seconds_dist", "Makespan of steps",
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800))
migrations_total = Counter(NS + "migrations", "Chunks that resumed on another worker than the previous one")
workers_registered = Gauge(NS + "workers_registered", "Workers known to the scheduler", ["healthy"])
step_spec_draft_tokens = Gauge(NS + "step_spec_draft_tokens", "Draft tokens of the last finished step")
step_spec_accepted_tokens = Gauge(NS + "step_spec_accepted_tokens", "Accepted draft tokens of the last step")
step_log_writes = Counter(NS + "step_log_writes",
                          "Finished samples written to the step log in Redis (ok), or not (failed, skipped)",
                          ["result"])
samples_in_flight = Gauge(NS + "samples_in_flight", "Samples admitted and not finished, all steps")

# --- trainer/rollout mismatch (scheduler; services/scheduler/mismatch.py) ------------
_DIFF_BUCKETS = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0)  # 0: bitwise-identical tokens
logprob_abs_diff = BulkHistogram(
    NS + "trainer_logprob_abs_diff", "Per token: |rollout logprob - trainer logprob| of reported samples",
    _DIFF_BUCKETS)
logprob_kl = BulkHistogram(
    NS + "trainer_logprob_kl", "Per sample: k3 estimate of KL(rollout || trainer) over its tokens", _DIFF_BUCKETS)
step_logprob_abs_diff = Gauge(NS + "step_trainer_logprob_abs_diff",
                              "Mean |rollout - trainer logprob| over the last reported step's tokens")
step_logprob_kl = Gauge(NS + "step_trainer_logprob_kl", "k3 estimate of KL(rollout || trainer) of the last reported step")

# --- history ------------------------------------------------------------------------
worker_step_failures = Counter(NS + "worker_step_failures", "Engine steps that raised (the batch is re-run in halves)",
                               ["worker"])
samples_failed_total = Counter(NS + "samples_failed", "Samples given up after failing on workers")
history_requests = Counter(NS + "history_requests", "History RPCs served", ["method"])
history_prompts_looked_up = Counter(NS + "history_prompts_looked_up", "Prompts looked up in history")
history_prompts_hit = Counter(NS + "history_prompts_hit", "Looked-up prompts that had stored epochs")
history_rollouts_written = Counter(NS + "history_rollouts_written", "Rollouts newly stored")


TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class _MetricsHandler(BaseHTTPRequestHandler):
    """GET /metrics in the classic text format (0.0.4), whatever the scraper asks for.

    prometheus_client negotiates OpenMetrics with Prometheus 2.x/3.x scrapers and then
    escapes the ':' of our vLLM-style names (``rhymerl:...`` arrives as ``rhymerl_...``);
    the text format keeps names as written, so dashboards and recording rules match.
    """

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", TEXT_FORMAT)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - scrapes are not news
        return


def _bind_reason(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "in use by another process"
    return exc.strerror or str(exc)


def serve_metrics(port: int, addr: str = "0.0.0.0") -> ThreadingHTTPServer | None:
    """Starts the /metrics HTTP endpoint in a daemon thread (port 0 disables it)."""
    if not port:
        return None
    try:
        server = ThreadingHTTPServer((addr, port), _MetricsHandler)
    except OSError as exc:  # "[Errno 98] Address already in use", naming no port
        from services.common.errors import BindError

        raise BindError("metrics port", f"{addr}:{port}", _bind_reason(exc), "metrics_port") from exc
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
