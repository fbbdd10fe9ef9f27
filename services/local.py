"""The whole system on one machine, as real processes: what `make run` and the e2e tests start.

LocalCluster starts the history service (with its embedded redis-server), the
scheduler and N CPU rollout workers, each a `rhymerl` sub-command in its own
process with its settings in the environment, exactly as in a deployment.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.redis_server import free_port, spawn_tied

ROOT = Path(__file__).resolve().parent.parent


def stop_process(proc: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM (it drains), then SIGKILL if it is still there after ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (0 if it is not running)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class StartStop:
    """``with`` over ``start()`` (returning self) and ``stop()``; a start that fails part
    way stops what it had started."""

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


READY_SERVICE = {"history": "rhymerl.v1.HistoryService", "scheduler": "rhymerl.v1.RolloutService",
                 "worker": "rhymerl.v1.WorkerService"}


@dataclass
class LocalCluster(StartStop):
    """The services as separate processes on loopback, each one killable and restartable
    by name ("redis", "history", "scheduler", "worker-<i>"): what the e2e tests, the
    chaos campaign and `make run` start.

    Args:
        separate_redis: run redis-server as a process of its own (append-only file, so a
            kill -9 loses nothing written) that history and the scheduler's step log
            share; otherwise history embeds a private one and the step log is off.
        extra_env: environment for every process (after the defaults).
        worker_env: per worker name, environment over extra_env.
    """

    model_dir: str
    num_workers: int = 2
    policy: str = "rhymerl"
    chunk_tokens: int = 64
    log_dir: Path = ROOT / "runs" / "local"
    extra_env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, dict] = field(default_factory=dict)  # per worker name, over extra_env
    separate_redis: bool = False
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    scheduler_health_port: int = 0  # its health process (liveness and readiness off its event loop)
    commands: dict[str, tuple[list[str], dict]] = field(default_factory=dict)

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.ports['scheduler']}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports['redis']}/0" if "redis" in self.ports else ""

    @property
    def workers(self) -> list[str]:
        return [f"worker-{i}" for i in range(self.num_workers)]

    def start(self, timeout_s: float = 120.0) -> "LocalCluster":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        names = ["redis"] * self.separate_redis + ["history", "scheduler", *self.workers]
        for name in names:
            self.ports[name], self.metrics_ports[name] = free_port(), free_port()
        self.scheduler_health_port = free_port()
        history = f"127.0.0.1:{self.ports['history']}"
        if self.separate_redis:
            from services.common.redis_server import find_redis_server

            (self.log_dir / "redis").mkdir(exist_ok=True)
            self._spawn("redis", [find_redis_server(), "--port", str(self.ports["redis"]), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "yes", "--appendfsync", "always",
                                  "--dir", str(self.log_dir / "redis")], {})
        self._spawn_service("history", "history", {
            "RHYMERL_HISTORY_HOST": "127.0.0.1", "RHYMERL_HISTORY_PORT": self.ports["history"],
            "RHYMERL_HISTORY_METRICS_PORT": self.metrics_ports["history"], "RHYMERL_HISTORY_REDIS_URL": self.redis_url,
            "RHYMERL_HISTORY_REDIS_TIMEOUT_S": 1.0})
        self._spawn_service("scheduler", "scheduler", {
            "RHYMERL_SCHEDULER_HOST": "127.0.0.1", "RHYMERL_SCHEDULER_PORT": self.ports["scheduler"],
            "RHYMERL_SCHEDULER_METRICS_PORT": self.metrics_ports["scheduler"],
            "RHYMERL_SCHEDULER_HEALTH_PORT": self.scheduler_health_port,
            "RHYMERL_SCHEDULER_HISTORY_ADDRESS": history, "RHYMERL_SCHEDULER_POLICY": self.policy,
            "RHYMERL_SCHEDULER_CHUNK_TOKENS": self.chunk_tokens, "RHYMERL_SCHEDULER_REDIS_URL": self.redis_url,
            # outlives a scheduler restart, as a pod's volume would (weight_store.py)
            "RHYMERL_SCHEDULER_WEIGHTS_DIR": self.log_dir / "scheduler-weights"})
        for name in self.workers:
            engine = {**self.extra_env, **self.worker_env.get(name, {})}.get("RHYMERL_WORKER_ENGINE", "rhymerl")
            kv_blocks = {} if engine == "vllm" else {"RHYMERL_WORKER_NUM_KV_BLOCKS": 1024}  # vLLM sizes its own
            self._spawn_service(name, "worker", {**kv_blocks,
                "RHYMERL_WORKER_HOST": "127.0.0.1", "RHYMERL_WORKER_PORT": self.ports[name],
                "RHYMERL_WORKER_METRICS_PORT": self.metrics_ports[name], "RHYMERL_WORKER_ID": name,
                "RHYMERL_WORKER_ADVERTISE_ADDRESS": f"127.0.0.1:{self.ports[name]}",
                "RHYMERL_WORKER_MODEL_PATH": self.model_dir, "RHYMERL_WORKER_DEVICE": "cpu",
                "RHYMERL_WORKER_DTYPE": "float32", "RHYMERL_WORKER_MAX_NUM_SEQS": 64,
                "RHYMERL_WORKER_SCHEDULER_ADDRESS": self.scheduler_address,
                "RHYMERL_WORKER_HISTORY_ADDRESS": history}, self.worker_env.get(name, {}))
        deadline = time.monotonic() + timeout_s
        # Every process started is watched while any is awaited: the scheduler is ready only
        # once a worker serves, so a worker that exits at start (a model that does not load)
        # is said at once, with its log's tail, not as "scheduler not ready" at the deadline.
        for name in names:
            self.wait_ready(name, deadline - time.monotonic(), watch=names)
        self.wait_registered(deadline - time.monotonic(), watch=names)
        return self

    def _spawn_service(self, name: str, command: str, env: dict, own: dict | None = None) -> None:
        # a worker's own (worker_env) over extra_env over the defaults
        env = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env, **self.extra_env, **(own or {})}
        if env.get("RHYMERL_WORKER_ENGINE") == "vllm":
            from services.rollout.vllm_engine.builder import intel_openmp_env

            env = intel_openmp_env(env)
        self._spawn(name, [sys.executable, "-m", "services.cli", command], env)

    def _spawn(self, name: str, argv: list[str], env: dict) -> None:
        self.commands[name] = (argv, env)
        full_env = {**os.environ, **self.extra_env, **{k: str(v) for k, v in env.items()}}
        log = open(self.log_dir / f"{name}.log", "a")
        # (tied: a launcher killed with SIGKILL, or a test run cut short, leaves no service behind)
        self.procs[name] = spawn_tied(argv, cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    # --- process control (tests and the chaos campaign) ------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> int:
        """Sends ``sig`` (kill -9 by default; SIGTERM drains) and waits for the exit code."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def restart(self, name: str, timeout_s: float = 120.0, wait: bool = True) -> None:
        """Starts ``name`` again, same command, ports and environment (after it exited)."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        self._spawn(name, *self.commands[name])
        if wait:
            self.wait_ready(name, timeout_s)

    def is_running(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def rss_bytes(self, name: str) -> int:
        """Resident memory of a running process (0 if it is not running)."""
        return rss_bytes(self.procs[name].pid)

    def wait_ready(self, name: str, timeout_s: float, watch: Iterable[str] = ()) -> None:
        """Until ``name`` answers as ready: Redis a PING, a service its gRPC readiness. An exit
        of ``name``, or of a process in ``watch``, ends the wait with a RuntimeError."""
        deadline = time.monotonic() + timeout_s
        if name == "redis":
            import redis

            client = redis.Redis(port=self.ports["redis"], socket_timeout=1)
            self._poll(name, deadline, lambda: client.ping(), watch)
            client.close()
            return
        service = READY_SERVICE[name.split("-")[0]]
        with grpc.insecure_channel(f"127.0.0.1:{self.ports[name]}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            self._poll(name, deadline, lambda: stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                       .status == health_pb2.HealthCheckResponse.SERVING, watch)

    def wait_registered(self, timeout_s: float, expected: int | None = None, watch: Iterable[str] = ()) -> float:
        """Until ``expected`` workers (default: every running one) are registered and
        healthy; returns the seconds waited. An exit of a process in ``watch`` ends the
        wait with a RuntimeError."""
        from rhymerl import RolloutClient

        started = time.monotonic()
        expected = sum(self.is_running(w) for w in self.workers) if expected is None else expected
        with RolloutClient(self.scheduler_address, timeout_s=5, max_retries=0) as client:
            self._poll("scheduler", started + timeout_s,
                       lambda: len([w for w in client.stats().workers if w.healthy]) >= expected, watch)
        return time.monotonic() - started

    def _poll(self, name: str, deadline: float, ready, watch: Iterable[str] = ()) -> None:
        while True:
            for other in [name, *watch]:
                if self.procs[other].poll() is not None:
                    raise RuntimeError(f"{other} exited; see {self.log_dir / (other + '.log')}:\n{self.tail(other)}")
            try:
                if ready():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready; see {self.log_dir / (name + '.log')}")
            time.sleep(0.1)

    def scrape(self, name: str, timeout_s: float = 5.0) -> str:
        """The Prometheus text ``name`` serves on its metrics port now."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics", timeout=timeout_s) as r:
            return r.read().decode()

    def engine_counters(self) -> dict[str, float]:
        """Every worker's engine counters now, summed: ``<kind>_steps`` and ``<kind>_s`` (the
        engine_step_seconds histogram's count and sum by kind: prefill, decode, verify),
        ``<mode>_forwards`` (graph, eager) and ``prompt_tokens``."""
        from prometheus_client.parser import text_string_to_metric_families

        names = {"rhymerl:engine_step_seconds_count": "{kind}_steps", "rhymerl:engine_step_seconds_sum": "{kind}_s",
                 "rhymerl:engine_forwards_total": "{mode}_forwards", "rhymerl:prompt_tokens_total": "prompt_tokens"}
        totals: dict[str, float] = {}
        for name in self.workers:
            for family in text_string_to_metric_families(self.scrape(name, timeout_s=10)):
                for sample in family.samples:
                    if sample.name in names:
                        key = names[sample.name].format(**sample.labels)
                        totals[key] = totals.get(key, 0.0) + sample.value
        return totals

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the workers first (each drains: it deregisters from the scheduler,
        which must still answer, and finishes its chunks), then to the scheduler and
        history, then to Redis; SIGKILL to what lingers."""
        workers = [n for n in self.procs if n.startswith("worker")]
        services = [n for n in self.procs if n not in workers and n != "redis"]
        for group in (workers, services, [n for n in self.procs if n == "redis"]):
            for name in group:
                if self.procs[name].poll() is None:
                    self.procs[name].send_signal(signal.SIGTERM)
            for name in group:
                try:
                    self.procs[name].wait(15)
                except subprocess.TimeoutExpired:
                    self.procs[name].kill()
                    self.procs[name].wait()

