"""The whole system on one machine, as real processes: what `make run` and the e2e tests start.

LocalCluster starts the history service (with its embedded redis-server), the
scheduler and N CPU rollout workers, each a `rhymerl` sub-command in its own
process with its settings in the environment, exactly as in a deployment.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.redis_server import free_port

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LocalCluster:
    model_dir: str
    num_workers: int = 2
    policy: str = "rhymerl"
    chunk_tokens: int = 64
    log_dir: Path = ROOT / "runs" / "local"
    extra_env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    metrics_ports: dict[str, int] = field(default_factory=dict)

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.ports['scheduler']}"

    def start(self, timeout_s: float = 120.0) -> "LocalCluster":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name in ["history", "scheduler", *[f"worker-{i}" for i in range(self.num_workers)]]:
            self.ports[name], self.metrics_ports[name] = free_port(), free_port()
        history = f"127.0.0.1:{self.ports['history']}"
        self._spawn("history", "history", {
            "RHYMERL_HISTORY_HOST": "127.0.0.1", "RHYMERL_HISTORY_PORT": self.ports["history"],
            "RHYMERL_HISTORY_METRICS_PORT": self.metrics_ports["history"]})
        self._spawn("scheduler", "scheduler", {
            "RHYMERL_SCHEDULER_HOST": "127.0.0.1", "RHYMERL_SCHEDULER_PORT": self.ports["scheduler"],
            "RHYMERL_SCHEDULER_METRICS_PORT": self.metrics_ports["scheduler"],
            "RHYMERL_SCHEDULER_HISTORY_ADDRESS": history, "RHYMERL_SCHEDULER_POLICY": self.policy,
            "RHYMERL_SCHEDULER_CHUNK_TOKENS": self.chunk_tokens})
        for i in range(self.num_workers):
            name = f"worker-{i}"
            self._spawn(name, "worker", {
                "RHYMERL_WORKER_HOST": "127.0.0.1", "RHYMERL_WORKER_PORT": self.ports[name],
                "RHYMERL_WORKER_METRICS_PORT": self.metrics_ports[name], "RHYMERL_WORKER_ID": name,
                "RHYMERL_WORKER_ADVERTISE_ADDRESS": f"127.0.0.1:{self.ports[name]}",
                "RHYMERL_WORKER_MODEL_PATH": self.model_dir, "RHYMERL_WORKER_DEVICE": "cpu",
                "RHYMERL_WORKER_DTYPE": "float32", "RHYMERL_WORKER_MAX_NUM_SEQS": 64,
                "RHYMERL_WORKER_NUM_KV_BLOCKS": 1024,
                "RHYMERL_WORKER_SCHEDULER_ADDRESS": self.scheduler_address,
                "RHYMERL_WORKER_HISTORY_ADDRESS": history})
        deadline = time.monotonic() + timeout_s
        for name, port in self.ports.items():
            self._wait_serving(name, port, deadline)
        self._wait_registered(deadline)
        return self

    def _spawn(self, name: str, command: str, env: dict) -> None:
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                    **{k: str(v) for k, v in env.items()}, **self.extra_env}
        log = open(self.log_dir / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([sys.executable, "-m", "services.cli", command],
                                            cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)

    def _wait_serving(self, name: str, port: int, deadline: float) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} exited; see {self.log_dir / (name + '.log')}:\n{self.tail(name)}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not serving; see {self.log_dir / (name + '.log')}")
                time.sleep(0.2)

    def _wait_registered(self, deadline: float) -> None:
        from rhymerl import RolloutClient

        with RolloutClient(self.scheduler_address, timeout_s=5) as client:
            while len([w for w in client.stats().workers if w.healthy]) < self.num_workers:
                if time.monotonic() > deadline:
                    raise TimeoutError("workers did not register with the scheduler")
                time.sleep(0.2)

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        return "\n".join(path.read_text().splitlines()[-lines:]) if path.exists() else ""

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def stop(self) -> None:
        """SIGTERM to all (workers drain first), then SIGKILL what lingers."""
        order = sorted(self.procs, key=lambda n: (not n.startswith("worker"), n != "scheduler"))
        for name in order:
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def ensure_model(model_dir: str) -> None:
    """Trains the tiny policy (deterministic, ~3 minutes on 2 cores) if it is not there yet."""
    if (Path(model_dir) / "config.json").exists():
        return
    print(f"training the tiny policy into {model_dir} (first run only)...", flush=True)
    subprocess.run([sys.executable, "-m", "benchmarks.policy.train_sft", "--preset", "tiny", "--out", model_dir,
                    "--seed", "0"], cwd=ROOT, check=True)


def load_example(name: str):
    """Imports a module from clients/python/examples (they are scripts, not a package)."""
    path = ROOT / "clients" / "python" / "examples" / f"{name}.py"
    module_name = f"rhymerl_examples_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
