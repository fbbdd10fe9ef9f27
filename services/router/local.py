"""Scheduler shards behind a step router, as real processes on loopback: what the router's
e2e tests and the shards benchmark start.

One redis-server is the shard registry; each shard is a ``LocalCluster`` (its history,
scheduler and CPU workers) whose scheduler announces itself there; the router is a
``rhymerl router`` process reading it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common.redis_server import EmbeddedRedis, free_port
from services.local import ROOT, LocalCluster, StartStop, rss_bytes, stop_process


@dataclass
class ShardedCluster(StartStop):
    """``num_shards`` shards of ``workers_per_shard`` CPU workers each, and a router.

    Args:
        shard_ttl_s: the shards' registry TTL (a hung shard leaves after it).
        max_num_seqs: each worker's slots (a shard's capacity is their sum).
        router_env: environment of the router process (RHYMERL_ROUTER_*).
        worker_env: environment of every worker (RHYMERL_WORKER_*).
        extra_env: environment of every shard's processes (history, scheduler, workers).
        separate_redis: each shard with a redis-server of its own for its history and
            its scheduler's step log (``LocalCluster``'s): a restarted shard then knows
            its serving version from the record of its last push.

    Processes have names for ``kill`` and ``restart`` (the chaos campaign's faults):
    "router", and "shard-<i>/<name>" for a shard's own ("shard-0/scheduler",
    "shard-1/worker-0", "shard-0/history", "shard-0/redis").
    """

    model_dir: str
    num_shards: int = 2
    workers_per_shard: int = 1
    policy: str = "rhymerl"
    chunk_tokens: int = 64
    max_num_seqs: int = 64
    shard_ttl_s: float = 10.0
    log_dir: Path = ROOT / "runs" / "sharded"
    router_env: dict[str, str] = field(default_factory=dict)
    worker_env: dict[str, str] = field(default_factory=dict)  # every worker's (RHYMERL_WORKER_*)
    extra_env: dict[str, str] = field(default_factory=dict)
    separate_redis: bool = False
    shards: list[LocalCluster] = field(default_factory=list)
    registry: EmbeddedRedis | None = None
    router: subprocess.Popen | None = None
    router_port: int = 0
    router_metrics_port: int = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.router_port}"

    @property
    def scheduler_address(self) -> str:
        """Where trainers call: the router (the name ``LocalCluster`` gives it)."""
        return self.address

    @property
    def workers(self) -> list[str]:
        return [f"shard-{i}/{w}" for i, shard in enumerate(self.shards) for w in shard.workers]

    def start(self, timeout_s: float = 180.0) -> "ShardedCluster":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.registry = EmbeddedRedis().start()
        for i in range(self.num_shards):
            shard = LocalCluster(
                model_dir=self.model_dir, num_workers=self.workers_per_shard, policy=self.policy,
                chunk_tokens=self.chunk_tokens, log_dir=self.log_dir / f"shard-{i}", separate_redis=self.separate_redis,
                extra_env={**self.extra_env, "RHYMERL_SCHEDULER_SHARD_REGISTRY_URL": self.registry.url,
                           "RHYMERL_SCHEDULER_SHARD_ID": f"shard-{i}",
                           "RHYMERL_SCHEDULER_SHARD_TTL_S": str(self.shard_ttl_s)},
                worker_env={f"worker-{j}": {"RHYMERL_WORKER_ID": f"s{i}-worker-{j}",
                                            "RHYMERL_WORKER_MAX_NUM_SEQS": self.max_num_seqs, **self.worker_env}
                            for j in range(self.workers_per_shard)})
            self.shards.append(shard)
            shard.start(timeout_s)
        self.router_port, self.router_metrics_port = free_port(), free_port()
        self._spawn_router()
        self.wait_router(timeout_s, every_shard_usable=True)
        return self

    def _spawn_router(self) -> None:
        env = {"RHYMERL_ROUTER_HOST": "127.0.0.1", "RHYMERL_ROUTER_PORT": self.router_port,
               "RHYMERL_ROUTER_METRICS_PORT": self.router_metrics_port,
               "RHYMERL_ROUTER_REGISTRY_URL": self.registry.url, "RHYMERL_ROUTER_REFRESH_S": 0.5,
               "PYTHONUNBUFFERED": "1", **self.router_env}
        log = open(self.log_dir / "router.log", "a")
        self.router = subprocess.Popen([sys.executable, "-m", "services.cli", "router"], cwd=ROOT,
                                       env={**os.environ, **{k: str(v) for k, v in env.items()}},
                                       stdout=log, stderr=subprocess.STDOUT)
        log.close()

    # --- process control by name (the chaos campaign) ----------------------------------
    def _locate(self, name: str) -> tuple[LocalCluster, str]:
        shard, _, proc = name.partition("/")
        if not shard.startswith("shard-") or not proc:
            raise KeyError(f"no process {name!r}: 'router' or 'shard-<i>/<name>'")
        return self.shards[int(shard.removeprefix("shard-"))], proc

    def kill(self, name: str, sig: int = signal.SIGKILL, timeout_s: float = 30.0) -> int:
        """Sends ``sig`` to the named process and waits for its exit code."""
        if name != "router":
            shard, proc = self._locate(name)
            return shard.kill(proc, sig, timeout_s)
        if self.router.poll() is None:
            self.router.send_signal(sig)
        try:
            return self.router.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.router.kill()
            return self.router.wait()

    def restart(self, name: str, timeout_s: float = 120.0, wait: bool = True) -> None:
        """Starts the named process again, same ports and environment (after it exited)."""
        if name != "router":
            shard, proc = self._locate(name)
            shard.restart(proc, timeout_s, wait)
            return
        if self.router.poll() is None:
            raise RuntimeError("the router is still running")
        self._spawn_router()
        if wait:
            self.wait_router(timeout_s)

    def rss_bytes(self, name: str) -> int:
        if name != "router":
            shard, proc = self._locate(name)
            return shard.rss_bytes(proc)
        return rss_bytes(self.router.pid)

    def router_metrics(self) -> list:
        """The router's Prometheus samples now (name, labels, value)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.router_metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def shard_usable(self) -> dict[str, bool]:
        """The router's view now (its ``rhymerl:router_shard_usable`` gauge): which shards
        it would give work to."""
        return {s.labels["shard"]: s.value == 1.0 for s in self.router_metrics()
                if s.name == "rhymerl:router_shard_usable"}

    def wait_shard_serving(self, shard: int, timeout_s: float, expected: int | None = None) -> float:
        """Until shard ``shard`` has ``expected`` workers registered (default: every running
        one) and the router gives it work again; returns the seconds waited."""
        started = time.monotonic()
        self.shards[shard].wait_registered(timeout_s, expected)
        deadline = started + timeout_s
        while True:
            try:
                if self.shard_usable().get(f"shard-{shard}"):
                    return time.monotonic() - started
            except OSError:  # the router restarting
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the router does not use shard-{shard}; see {self.log_dir / 'router.log'}")
            time.sleep(0.1)

    def wait_router(self, timeout_s: float, every_shard_usable: bool = False) -> None:
        """Until the router is ready and sees every running shard's workers; with
        ``every_shard_usable`` (a fresh cluster: every shard at the first version), also
        until it would give work to every shard that can serve (not so after a restart: a
        shard behind the version waits for the next push there)."""
        from rhymerl import RolloutClient

        deadline = time.monotonic() + timeout_s
        expected = sum(s.is_running(w) for s in self.shards for w in s.workers)
        # the shards the router should give work to: a running scheduler with a running worker
        serving = [f"shard-{i}" for i, s in enumerate(self.shards)
                   if every_shard_usable and s.is_running("scheduler") and any(s.is_running(w) for w in s.workers)]
        while True:
            if self.router.poll() is not None:
                raise RuntimeError(f"router exited; see {self.log_dir / 'router.log'}")
            try:
                with RolloutClient(self.address, timeout_s=5, max_retries=0) as client:
                    healthy = len([w for w in client.stats().workers if w.healthy]) >= expected
                # and the registry's view (capacity announced, refreshed about every second)
                # has caught up: a step sent before would go to the shards seen so far only
                usable = self.shard_usable() if healthy and serving else {}
                if healthy and all(usable.get(name) for name in serving) and self._ready():
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"router not ready; see {self.log_dir / 'router.log'}")
            time.sleep(0.2)

    def _ready(self) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as ch:
            answer = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="rhymerl.v1.RolloutService"), timeout=1)
        return answer.status == health_pb2.HealthCheckResponse.SERVING

    def scheduler_pid(self, shard: int) -> int:
        return self.shards[shard].procs["scheduler"].pid

    def signal_scheduler(self, shard: int, sig: int) -> None:
        self.shards[shard].procs["scheduler"].send_signal(sig)

    def stop(self) -> None:
        if self.router is not None:
            stop_process(self.router, 15)
        for shard in self.shards:
            if shard.procs.get("scheduler") is not None and shard.procs["scheduler"].poll() is None:
                shard.procs["scheduler"].send_signal(signal.SIGCONT)  # a test may have stopped it
            shard.stop()
        if self.registry is not None:
            self.registry.stop()
