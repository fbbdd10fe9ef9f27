"""Is the scheduler process the bottleneck? The real `rhymerl scheduler`, a fleet of fake
workers that answer instantly, one trainer, real gRPC on loopback.

    python -m benchmarks.control_plane                        # W in {64, 512} x S in {8192, 65536}, static and rhymerl
    python -m benchmarks.control_plane --workers 1024 --samples 16384 --policies rhymerl --out-name NAME
    python -m benchmarks.control_plane --workers 512 --samples 65536 --trainers 1,16 --step-log both
    python -m benchmarks.control_plane --workers 1024 --samples 65536 --policies rhymerl --idle-workers 1024,2048

Per row (workers W x samples S x trainers T x step log x policy), everything fresh:
1. The scheduler as its CLI starts it (``python -m services.cli scheduler``, no history;
   the step log, with ``--step-log``, in a fresh redis-server), its own process; its log
   in a temporary directory (``--log-dir`` keeps it).
2. W fake workers (``benchmarks/fake_fleet.py``: 64 WorkerService endpoints per process,
   each registering and heartbeating as a real worker does, ``--slots`` slots,
   ``--response-tokens`` tokens per sample, answered at once).
3. Once every worker is registered and healthy, ``--settle-s`` seconds idle (the
   scheduler's idle CPU: heartbeats), then T trainers (threads of this process) each
   submit a step of S / T samples (S / T / ``--n`` prompts x ``--n``) at once and read
   their streams to the summary.
   Meanwhile two separate processes ask grpc.health.v1 Check, liveness ("") and
   readiness (RolloutService) in turn, 10 s timeout, back to back with 50 ms pauses:
   one the scheduler's health process (its health port, what the probes ask: the
   row's ``health_*``), one its gRPC port (answered by its event loop: ``health_main_*``).
4. ``--idle-workers``: rows of their own (``idle``), a fresh scheduler and fleet and no
   step: ``--idle-s`` seconds of heartbeats alone, the scheduler's CPU per 1,000
   workers, the stats polls the fleet answered (registered workers are never polled).

Reported: samples/s and chunks/s (the work items the fleet answered during the step,
over the step's wall time), the batches they came in (LinkRequest messages the fleet
read), the scheduler's CPU-seconds per 1k samples over the step (utime + stime from
/proc/<pid>/stat), its peak RSS (VmHWM), health-check latency p50 / p99 / max, failures
and answers other than SERVING during the step, time to the first and to the median
sample,
and workers marked unhealthy and dropped over the row's whole life (the scheduler's log).
Each row checks its counts: every (prompt, sample) delivered once.

On a shared machine the fakes, the trainer and the scheduler share the cores: CPU-
seconds of the scheduler are the honest figure, wall-clock rates are a lower bound.
Writes benchmarks/results/<out-name>.{md,json} (``rows``, ``idle``, device, commit, command).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rhymerl.types import event_samples
from rhymerl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from benchmarks.fake_fleet import FakeFleet, FleetSpec
from benchmarks.provenance import cpu_name, git_commit
from benchmarks.report import markdown_table
from services.common.redis_server import EmbeddedRedis, free_port
from services.local import stop_process

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TICKS = os.sysconf("SC_CLK_TCK")
HEALTH_TIMEOUT_S = 10.0

COLUMNS = [("policy", "policy", "{}"), ("workers", "workers", "{}"), ("samples", "samples", "{}"),
           ("trainers", "trainers", "{}"), ("step log", "step_log", "{}"),
           ("samples/s", "samples_per_s", "{:.0f}"), ("chunks/s", "chunks_per_s", "{:.0f}"),
           ("sched CPU ms / 1k samples", "sched_cpu_ms_per_1k", "{:.0f}"), ("peak RSS MB", "peak_rss_mb", "{:.0f}"),
           ("health p99 ms", "health_p99_ms", "{:.0f}"), ("health max ms", "health_max_ms", "{:.0f}"),
           ("health not SERVING", "health_not_serving", "{}"),
           ("gRPC-port health p99 ms", "health_main_p99_ms", "{:.0f}"),
           ("first sample s", "first_sample_s", "{:.2f}"), ("median sample s", "median_sample_s", "{:.2f}"),
           ("wall s", "wall_s", "{:.1f}"), ("marked unhealthy (in step)", "unhealthy_cell", "{}"),
           ("chunks re-run", "chunks_rerun", "{}"), ("Link batches", "batches", "{}"),
           ("idle CPU cores", "idle_cpu_cores", "{:.3f}")]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (fields 14 and 15 of /proc/<pid>/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICKS


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


class SchedulerProcess:
    """``python -m services.cli scheduler`` on free ports, settings from the environment."""

    def __init__(self, policy: str, log_path: Path, env: dict[str, str],
                 channel_options: tuple[tuple[str, int], ...] = ()):
        self.port, self.health_port, self.log_path = free_port(), free_port(), log_path
        full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "RHYMERL_SCHEDULER_HOST": "127.0.0.1", "RHYMERL_SCHEDULER_PORT": str(self.port),
                "RHYMERL_SCHEDULER_HEALTH_PORT": str(self.health_port),
                "RHYMERL_SCHEDULER_METRICS_PORT": "0", "RHYMERL_SCHEDULER_HISTORY_ADDRESS": "",
                "RHYMERL_SCHEDULER_REDIS_URL": "", "RHYMERL_SCHEDULER_POLICY": policy, **env}
        argv = [sys.executable, "-m", "services.cli", "scheduler"]
        if channel_options:  # the same CLI, its channels given these options too
            full["RHYMERL_BENCH_CHANNEL_OPTIONS"] = json.dumps(channel_options)
            argv[1:3] = ["-c", ("from benchmarks.fake_fleet import add_channel_options; add_channel_options(); "
                                "import sys; sys.argv[0] = 'rhymerl'; from services.cli import app; app()")]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=full,
                                         stdout=log, stderr=subprocess.STDOUT)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def health_address(self) -> str:
        """Its health process (what the kubelet's probes ask)."""
        return f"127.0.0.1:{self.health_port}"

    def _poll(self, ask, ready, timeout_s: float, interval_s: float, what: str) -> None:
        """Calls ``ask`` until ``ready(answer)``; an RPC error counts as not ready yet."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the scheduler exited:\n{self.log_tail()}")
            try:
                if ready(ask()):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} in {timeout_s} s:\n{self.log_tail()}")
            time.sleep(interval_s)

    def wait_serving(self, timeout_s: float = 60.0) -> None:
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            self._poll(lambda: stub.Check(health_pb2.HealthCheckRequest(), timeout=1),
                       lambda reply: reply.status == health_pb2.HealthCheckResponse.SERVING,
                       timeout_s, 0.1, "the scheduler did not serve")

    def wait_workers(self, expected: int, timeout_s: float) -> None:
        """Until ``expected`` workers are registered and healthy."""
        with grpc.insecure_channel(self.address) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            self._poll(lambda: stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10),
                       lambda stats: sum(w.healthy for w in stats.workers) >= expected,
                       timeout_s, 0.25, f"{expected} workers not registered")

    def log_count(self, text: str) -> int:
        return sum(text in line for line in self.log_path.read_text(errors="replace").splitlines())

    def log_heartbeat_s(self) -> float:
        """The heartbeat interval the scheduler says it runs with (its start-up line)."""
        for line in self.log_path.read_text(errors="replace").splitlines():
            if "heartbeat " in line and "listening on" in line:
                return float(line.split("heartbeat ", 1)[1].split(" s", 1)[0])
        return float("nan")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        stop_process(self.proc, 30)


def _health_prober(address: str, stop, conn) -> None:
    """In its own process (the trainer's GIL must not delay it): Check liveness ("") and
    readiness (RolloutService) in turn until ``stop``, then send the latencies in seconds
    (a failed check counts as its full timeout), the number of failures and of answers
    other than SERVING (the fleet can serve throughout: every answer should be SERVING)."""
    latencies, failures, not_serving = [], 0, 0
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        conn.send("ready")
        for service in itertools.cycle(["", "rhymerl.v1.RolloutService"]):
            if stop.is_set():
                break
            started = time.perf_counter()
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=HEALTH_TIMEOUT_S)
                latencies.append(time.perf_counter() - started)
                not_serving += reply.status != health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                failures += 1
                latencies.append(max(HEALTH_TIMEOUT_S, time.perf_counter() - started))
            stop.wait(0.05)
    conn.send((latencies, failures, not_serving))


class HealthProbers:
    """One prober process per address (the scheduler's health process, its gRPC port)."""

    def __init__(self, addresses: dict[str, str]):
        ctx = multiprocessing.get_context("spawn")
        self.stop_event, self.procs = ctx.Event(), {}
        for name, address in addresses.items():
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_health_prober, args=(address, self.stop_event, child), daemon=True)
            proc.start()
            self.procs[name] = (proc, parent)
        for proc, parent in self.procs.values():
            if not parent.poll(60):
                raise TimeoutError("a health prober did not start")
            parent.recv()

    def stop(self) -> dict[str, tuple[list[float], int, int]]:
        self.stop_event.set()
        out = {}
        for name, (proc, parent) in self.procs.items():
            out[name] = parent.recv() if parent.poll(HEALTH_TIMEOUT_S + 30) else ([], -1, -1)
            proc.join(10)
        return out


def _health_fields(prefix: str, latencies: list[float], failures: int, not_serving: int) -> dict:
    return {f"{prefix}_checks": len(latencies), f"{prefix}_failures": failures,
            f"{prefix}_not_serving": not_serving, f"{prefix}_p50_ms": 1e3 * _percentile(latencies, 0.5),
            f"{prefix}_p99_ms": 1e3 * _percentile(latencies, 0.99),
            f"{prefix}_max_ms": 1e3 * max(latencies, default=float("nan"))}


@dataclass
class StepStream:
    """What the trainer's SubmitStep stream delivered."""

    arrivals: list[float] = field(default_factory=list)  # seconds after submission, per sample
    keys: set = field(default_factory=set)
    duplicated: int = 0
    aborted: int = 0
    summary: rollout_pb2.StepSummary | None = None
    error: str = ""


def submit_step(address: str, step_id: str, prompts: int, n: int, max_tokens: int, timeout_s: float,
                started: float | None = None) -> StepStream:
    """One trainer's step; arrivals in seconds after ``started`` (perf_counter; default: now)."""
    request = rollout_pb2.SubmitStepRequest(
        step_id=step_id, n=n, sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=True,
                                                                 seed=1),
        prompts=[common_pb2.Prompt(prompt_id=f"p{i:06d}", token_ids=[2 + (i * 7 + j) % 30_000 for j in range(32)])
                 for i in range(prompts)])
    out = StepStream()
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 256 << 20)]) as ch:
        started = time.perf_counter() if started is None else started
        try:
            for event in rollout_pb2_grpc.RolloutServiceStub(ch).SubmitStep(request, timeout=timeout_s):
                if event.HasField("summary"):
                    out.summary = event.summary
                    continue
                arrived = time.perf_counter() - started
                for s in event_samples(event):
                    out.arrivals.append(arrived)
                    key = (s.prompt_id, s.sample_index)
                    out.duplicated += key in out.keys
                    out.aborted += s.finish_reason == common_pb2.FINISH_REASON_ABORT
                    out.keys.add(key)
        except grpc.RpcError as err:
            out.error = f"{err.code().name}: {err.details()}"
    return out


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_trainers(address: str, step_id: str, samples: int, trainers: int, n: int, max_tokens: int,
                 timeout_s: float) -> StepStream:
    """``trainers`` threads, each submitting its own step of samples / trainers samples at
    once; their streams merged (arrivals from the common start, in order)."""
    started = time.perf_counter()
    streams: list[StepStream] = [StepStream() for _ in range(trainers)]

    def one(i: int) -> None:
        streams[i] = submit_step(address, f"{step_id}-t{i}" if trainers > 1 else step_id, samples // trainers // n, n,
                                 max_tokens, timeout_s, started)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(trainers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    merged = StepStream(arrivals=sorted(a for s in streams for a in s.arrivals),
                        keys={(i, *k) for i, s in enumerate(streams) for k in s.keys},
                        duplicated=sum(s.duplicated for s in streams), aborted=sum(s.aborted for s in streams),
                        error="; ".join(s.error for s in streams if s.error))
    merged.summary = streams[0].summary if all(s.summary is not None for s in streams) else None
    return merged


def run_row(workers: int, samples: int, policy: str, *, trainers: int = 1, step_log: bool = False, n: int = 16,
            slots: int = 256, response_tokens: int = 16,
            per_process: int = 64, settle_s: float = 3.0, step_timeout_s: float = 1800.0,
            scheduler_env: dict[str, str] | None = None, log_dir: Path | None = None,
            channel_options: tuple[tuple[str, int], ...] = ()) -> dict:
    """One row: a fresh scheduler (with a fresh Redis for its step log if ``step_log``)
    and fleet, one step per trainer; the measurements and the counts."""
    if samples % (n * trainers):
        raise ValueError(f"samples ({samples}) must be a multiple of n x trainers ({n} x {trainers})")
    with tempfile.TemporaryDirectory(prefix="control-plane-") as tmp:
        name = f"scheduler-{policy}-w{workers}-s{samples}-t{trainers}{'-log' * step_log}.log"
        log_path = (log_dir or Path(tmp)) / name
        redis = EmbeddedRedis().start() if step_log else None
        env = {**(scheduler_env or {}), **({"RHYMERL_SCHEDULER_REDIS_URL": redis.url} if redis else {})}
        sched = SchedulerProcess(policy, log_path, env, channel_options)
        fleet = None
        try:
            sched.wait_serving()
            fleet = FakeFleet(FleetSpec(sched.address, workers, slots=slots, response_tokens=response_tokens,
                                        per_process=per_process, channel_options=channel_options)).start()
            sched.wait_workers(workers, timeout_s=120 + workers / 8)
            idle_cpu = cpu_seconds(sched.proc.pid)
            time.sleep(settle_s)
            idle_cores = (cpu_seconds(sched.proc.pid) - idle_cpu) / settle_s if settle_s else float("nan")

            probers = HealthProbers({"health": sched.health_address, "health_main": sched.address})
            before_fleet, before_cpu = fleet.stats(), cpu_seconds(sched.proc.pid)
            unhealthy_before = sched.log_count("marked unhealthy")
            started = time.perf_counter()
            stream = run_trainers(sched.address, f"bench-{policy}-{workers}-{samples}", samples, trainers, n,
                                  max_tokens=4 * response_tokens, timeout_s=step_timeout_s)
            wall = time.perf_counter() - started
            cpu = cpu_seconds(sched.proc.pid) - before_cpu
            health = probers.stop()
            after_fleet = fleet.stats()
            rss = peak_rss_mb(sched.proc.pid)
            # counted before the fleet stops (its servers' GOAWAY fails the next polls)
            unhealthy, dropped = sched.log_count("marked unhealthy"), sched.log_count("dropping worker")
            logging_on = sched.log_count("step log on") == 1
        finally:
            if fleet is not None:
                fleet.stop()
            sched.stop()
            if redis is not None:
                redis.stop()
        chunks = after_fleet["items"] - before_fleet["items"]
        chunks_needed = samples * -(-response_tokens // chunk_tokens(scheduler_env or {}, policy, response_tokens))
        row = {
            "policy": policy, "workers": workers, "samples": samples, "trainers": trainers, "step_log": step_log,
            "step_log_on": logging_on,
            "chunks_rerun": chunks - chunks_needed, "delivered": len(stream.keys), "lost": samples - len(stream.keys),
            "duplicated": stream.duplicated,
            "aborted": stream.aborted, "summary": stream.summary is not None, "error": stream.error,
            "chunks": chunks, "batches": after_fleet["batches"] - before_fleet["batches"],
            "wall_s": wall, "samples_per_s": len(stream.keys) / wall, "chunks_per_s": chunks / wall,
            "sched_cpu_s": cpu, "sched_cpu_ms_per_1k": 1e6 * cpu / max(1, len(stream.keys)),
            "peak_rss_mb": rss, **_health_fields("health", *health["health"]),
            **_health_fields("health_main", *health["health_main"]),
            "first_sample_s": stream.arrivals[0] if stream.arrivals else float("nan"),
            "median_sample_s": _percentile(stream.arrivals, 0.5),
            "marked_unhealthy": unhealthy, "marked_unhealthy_in_step": unhealthy - unhealthy_before,
            "workers_dropped": dropped, "channel_options": [list(o) for o in channel_options],
            "idle_cpu_cores": idle_cores, "slots": slots, "response_tokens": response_tokens, "n": n,
            "scheduler_env": scheduler_env or {},
        }
    row["unhealthy_cell"] = f"{row['marked_unhealthy']} ({row['marked_unhealthy_in_step']})"
    return row


def run_idle(workers: int, idle_s: float, *, slots: int = 256, per_process: int = 64,
             scheduler_env: dict[str, str] | None = None, log_dir: Path | None = None) -> dict:
    """A fresh scheduler and fleet, no step: once every worker is registered and healthy,
    ``idle_s`` seconds of heartbeats alone. The scheduler's CPU-seconds over them (per
    1,000 workers), the stats polls the fleet answered (registered workers are never
    polled), workers marked unhealthy or dropped, and health latency meanwhile."""
    with tempfile.TemporaryDirectory(prefix="control-plane-idle-") as tmp:
        log_path = (log_dir or Path(tmp)) / f"scheduler-idle-w{workers}.log"
        sched = SchedulerProcess("rhymerl", log_path, scheduler_env or {})
        fleet = None
        try:
            sched.wait_serving()
            fleet = FakeFleet(FleetSpec(sched.address, workers, slots=slots, per_process=per_process)).start()
            sched.wait_workers(workers, timeout_s=120 + workers / 8)
            probers = HealthProbers({"health": sched.health_address})
            unhealthy_before, before_fleet = sched.log_count("marked unhealthy"), fleet.stats()
            before_cpu, started = cpu_seconds(sched.proc.pid), time.perf_counter()
            time.sleep(idle_s)
            cpu, wall = cpu_seconds(sched.proc.pid) - before_cpu, time.perf_counter() - started
            load = os.getloadavg()
            health = probers.stop()
            after_fleet = fleet.stats()
            unhealthy, dropped = sched.log_count("marked unhealthy"), sched.log_count("dropping worker")
            heartbeat = sched.log_heartbeat_s()
        finally:
            if fleet is not None:
                fleet.stop()
            sched.stop()
    return {"workers": workers, "idle_s": wall, "heartbeat_s": heartbeat, "sched_cpu_s": cpu,
            "idle_cpu_cores": cpu / wall, "cores_per_1k_workers": 1e3 * cpu / wall / workers,
            "stats_polls": after_fleet["stats"] - before_fleet["stats"],
            "marked_unhealthy": unhealthy, "marked_unhealthy_idle": unhealthy - unhealthy_before,
            "workers_dropped": dropped, "load_average_after": load, **_health_fields("health", *health["health"]),
            "scheduler_env": scheduler_env or {}}


IDLE_COLUMNS = [("workers", "workers", "{}"), ("heartbeat s", "heartbeat_s", "{:g}"), ("idle s", "idle_s", "{:.1f}"),
                ("sched CPU s", "sched_cpu_s", "{:.2f}"), ("sched cores", "idle_cpu_cores", "{:.3f}"),
                ("cores / 1k workers", "cores_per_1k_workers", "{:.3f}"), ("stats polls", "stats_polls", "{}"),
                ("marked unhealthy (idle)", "unhealthy_cell", "{}"), ("dropped", "workers_dropped", "{}"),
                ("health p99 ms", "health_p99_ms", "{:.0f}"),
                ("load average 1 min", "load_1m", "{:.1f}")]


def chunk_tokens(env: dict[str, str], policy: str, response_tokens: int) -> int:
    """Tokens per chunk of a sample (divided rollout), as the scheduler's settings give it."""
    from services.scheduler.policies import make_policy, policy_options

    configured = int(env.get("RHYMERL_SCHEDULER_CHUNK_TOKENS", "0"))
    if "chunk_size" not in policy_options(policy):
        return response_tokens  # whole requests
    return configured or make_policy(policy).chunk_size


def write(result: dict, out: Path, name: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    if "shards" not in result and path.exists():  # the multi-process run (control_plane_shards.py) stays
        try:
            result["shards"] = json.loads(path.read_text())["shards"]
        except (ValueError, KeyError):
            pass
    path.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown_table(result["rows"], COLUMNS) if result["rows"] else ""
    idle = ""
    if result.get("idle"):
        for row in result["idle"]:
            row["unhealthy_cell"] = f"{row['marked_unhealthy']} ({row['marked_unhealthy_idle']})"
            row["load_1m"] = row["load_average_after"][0]
        idle = ("\n## Idle: heartbeats alone\n\nEvery worker registered and healthy, no step: the scheduler's "
                "CPU over the idle seconds (per 1,000 workers), the stats polls the fleet answered, workers marked "
                "unhealthy over the row's life (while idle), health latency on the health port meanwhile.\n\n"
                + markdown_table(result["idle"], IDLE_COLUMNS) + "\n")
    shards = ""
    if result.get("shards"):
        from benchmarks.control_plane_shards import markdown_section

        shards = markdown_section(result["shards"])
    (out / f"{name}.md").write_text(
        f"# Control plane: one scheduler process, fake workers\n\n`{result['command']}` at {result['commit']} on "
        f"{result['device']}\n\n{result['note']}\n\n{table}\n{idle}{shards}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    parser.add_argument("--workers", type=ints, default=[64, 512], help="fleet sizes, comma-separated")
    parser.add_argument("--samples", type=ints, default=[8192, 65536], help="samples per step, comma-separated")
    parser.add_argument("--policies", default="static,rhymerl", help="placement policies, comma-separated")
    parser.add_argument("--trainers", type=ints, default=[1],
                        help="trainers, comma-separated: each submits its own step of samples / trainers at once")
    parser.add_argument("--step-log", default="off", choices=["off", "on", "both"],
                        help="the scheduler's step log in a fresh redis-server (RHYMERL_SCHEDULER_REDIS_URL)")
    parser.add_argument("--n", type=int, default=16, help="samples per prompt")
    parser.add_argument("--slots", type=int, default=256, help="max_num_seqs each fake worker registers")
    parser.add_argument("--response-tokens", type=int, default=16)
    parser.add_argument("--per-process", type=int, default=64, help="fake workers per process")
    parser.add_argument("--settle-s", type=float, default=3.0, help="idle seconds before the step")
    parser.add_argument("--scheduler-env", action="append", default=[], metavar="KEY=VALUE",
                        help="extra environment for the scheduler (e.g. RHYMERL_SCHEDULER_CHUNK_TOKENS=8)")
    parser.add_argument("--step-timeout-s", type=float, default=1800.0, help="the trainer's deadline for the step")
    parser.add_argument("--channel-option", action="append", default=[], metavar="KEY=INT",
                        help="a gRPC option added to the scheduler's and the fakes' channels (e.g. "
                             "grpc.min_reconnect_backoff_ms=200, the option removed for issue 31)")
    parser.add_argument("--idle-workers", type=ints, default=[],
                        help="also idle rows at these fleet sizes (heartbeats alone, no step), comma-separated")
    parser.add_argument("--idle-s", type=float, default=30.0, help="the idle rows' measured seconds")
    parser.add_argument("--no-steps", action="store_true", help="only the idle rows")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the scheduler's logs here")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--out-name", default="control_plane")
    args = parser.parse_args(argv)
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)
    env = dict(kv.split("=", 1) for kv in args.scheduler_env)
    options = tuple((k, int(v)) for k, v in (kv.split("=", 1) for kv in args.channel_option))
    rows, idle = [], []
    for workers in args.idle_workers:
        row = run_idle(workers, args.idle_s, slots=args.slots, per_process=args.per_process, scheduler_env=env,
                       log_dir=args.log_dir)
        idle.append(row)
        print(f"idle W={workers}: {row['cores_per_1k_workers']:.3f} cores per 1k workers "
              f"({row['sched_cpu_s']:.2f} CPU-s in {row['idle_s']:.1f} s), {row['stats_polls']} stats polls, "
              f"{row['marked_unhealthy']} marked unhealthy, health p99 {row['health_p99_ms']:.1f} ms", flush=True)
    for policy in [] if args.no_steps else args.policies.split(","):
        for workers in args.workers:
            for samples, trainers, step_log in itertools.product(
                    args.samples, args.trainers, {"off": [False], "on": [True], "both": [False, True]}[args.step_log]):
                row = run_row(workers, samples, policy, trainers=trainers, step_log=step_log, n=args.n,
                              slots=args.slots, response_tokens=args.response_tokens, per_process=args.per_process,
                              settle_s=args.settle_s, step_timeout_s=args.step_timeout_s,
                              scheduler_env=env, log_dir=args.log_dir, channel_options=options)
                rows.append(row)
                print(markdown_table([row], COLUMNS).splitlines()[-1], flush=True)
    load = os.getloadavg()
    result = {
        "rows": rows, "idle": idle,
        "note": (f"{os.cpu_count()} cores shared by the scheduler, {args.per_process} fake workers per process, the "
                 f"trainer and the health prober (and other work on the machine: load average {load[0]:.1f} at the "
                 "end); the scheduler's CPU-seconds are the honest figure. Marked unhealthy: the scheduler's log over "
                 "the row's life up to the step's end, start-up included (in the step: during the step alone). Chunks "
                 "re-run: work items the fleet answered beyond one per chunk of every sample (re-dispatched work)."),
        "load_average": load,
        "command": " ".join(["python -m benchmarks.control_plane", *(sys.argv[1:] if argv is None else argv)]),
        "commit": git_commit(".", ":(exclude)benchmarks/results"), "device": f"CPU: {cpu_name()}",
    }
    if rows:
        print(markdown_table(rows, COLUMNS))
    write(result, args.out, args.out_name)
    return result


if __name__ == "__main__":
    out = main()
    sys.exit(0 if all(r["lost"] == 0 and r["duplicated"] == 0 and not r["error"] for r in out["rows"]) else 1)
