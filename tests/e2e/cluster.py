"""An in-process rhymerl: history (real redis-server), scheduler and workers on loopback gRPC."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from services.rollout.models.config import ModelConfig
from services.rollout.vllm_engine.smoke import TINY_VLLM

# The vLLM smoke model's shape, narrower (rhymerl's engine takes head_dim 16; vLLM's CPU attention does not).
TINY = {**TINY_VLLM, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}


def expect_status(err, code, field: str) -> None:
    """``err`` has status ``code`` (a grpc.StatusCode or its name) and names ``field`` first."""
    import grpc

    code = getattr(grpc.StatusCode, code) if isinstance(code, str) else code
    assert err.code() == code, (err.code(), err.details())
    assert err.details().startswith(field + ":"), err.details()


def wait_until(check, timeout_s: float, what: str) -> None:
    """Polls ``check`` until it holds; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


def prompts(k: int, length: int = 6, offset: int = 0):
    """``k`` distinct prompts p{offset}.. of ``length`` tokens inside the tiny vocabulary."""
    from rhymerl import Prompt

    return [Prompt(f"p{offset + i}", [2 + (7 * (offset + i) + 3 * j) % 90 for j in range(length)]) for i in range(k)]


def save_tiny_model(path: Path, seed: int = 0) -> Path:
    from services.rollout.loader import init_random_model, save_model

    save_model(init_random_model(ModelConfig(**TINY), seed), path)
    return path


@dataclass
class Cluster:
    """Runs the services on an event loop in a background thread; tests use the sync SDK."""

    model_dir: Path
    redis_url: str
    num_workers: int = 2
    policy: str = "rhymerl"
    chunk_tokens: int = 8
    speculative: bool = True
    batch_invariant: bool = False
    tls: dict = field(default_factory=dict)  # tls_* settings, given to every service
    auth_tokens: str = ""
    worker_tokens: str = ""  # the scheduler's RegistryService tokens (empty: auth_tokens)
    device: str = "cpu"  # "cuda": every worker shares the one GPU
    num_kv_blocks: int = 256  # each worker's KV cache, in blocks of 16 tokens
    scheduler_settings: dict = field(default_factory=dict)  # more SchedulerSettings fields
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)
    stops: list = field(default_factory=list)
    workers: dict = field(default_factory=dict)

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> "Cluster":
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.run(self._start())
        return self

    async def _start(self) -> None:
        from services.history.server import start_history
        from services.history.settings import HistorySettings

        _, history_port, stop = await start_history(
            HistorySettings(host="127.0.0.1", port=0, metrics_port=0, redis_url=self.redis_url, **self.tls))
        self.stops.append(stop)
        self.history_address = f"127.0.0.1:{history_port}"
        await self._start_scheduler()
        for i in range(self.num_workers):
            await self.add_worker(f"w{i}")
        while len(self.scheduler.core.workers.usable()) < self.num_workers:
            await asyncio.sleep(0.05)

    async def add_worker(self, worker_id: str):
        from services.rollout.server import start_worker
        from services.rollout.settings import WorkerSettings

        settings = WorkerSettings(host="127.0.0.1", port=0, metrics_port=0, id=worker_id,
                                  advertise_address="", model_path=str(self.model_dir), device=self.device,
                                  dtype="float32", max_num_seqs=32, num_kv_blocks=self.num_kv_blocks, block_size=16,
                                  speculative=self.speculative, batch_invariant=self.batch_invariant,
                                  measure_cost=False, scheduler_address=self.address,
                                  history_address=self.history_address, drain_timeout_s=5,
                                  scheduler_token=self.worker_token, **self.tls)
        server, port, stop = await _start_worker_advertised(settings, start_worker)
        self.workers[worker_id] = (server, stop)
        return server

    @property
    def worker_token(self) -> str:
        """The token the workers present: the first of the scheduler's worker tokens (or, with
        none, of its trainer tokens)."""
        tokens = [t.strip() for t in (self.worker_tokens or self.auth_tokens).split(",") if t.strip()]
        return tokens[0] if tokens else ""

    def wait_running(self, step_id: str | None = None, worker_id: str | None = None,
                     timeout_s: float = 120.0) -> None:
        """Until ``step_id`` (or any step) has chunks on the workers (``worker_id``: on that
        one); a hang guard, never a sleep: a busy machine may take longer to start it."""
        import time

        core, deadline = self.scheduler.core, time.monotonic() + timeout_s
        while (step_id is not None and step_id not in core.steps) or not core.runs.num_chunks or not any(
                w.state.running for w in core.workers.workers.values() if worker_id in (None, w.worker_id)):
            assert time.monotonic() < deadline, f"step {step_id} never started"
            time.sleep(0.01)

    def crash_scheduler(self) -> None:
        """Stops the scheduler abruptly (no grace, nothing saved), like kill -9 of its pod."""
        server = self.scheduler
        self.stops.remove(self._scheduler_stop)

        async def crash():
            await server.server.stop(0)
            await server.core.stop()
        self.run(crash())

    def start_scheduler(self) -> None:
        """Starts a fresh scheduler on the address the workers know."""
        self.run(self._start_scheduler(int(self.address.rsplit(":", 1)[1])))

    async def _start_scheduler(self, port: int = 0) -> None:
        from services.scheduler.server import start_scheduler
        from services.scheduler.settings import SchedulerSettings

        self.scheduler, port, self._scheduler_stop = await start_scheduler(SchedulerSettings(
            host="127.0.0.1", port=port, metrics_port=0, history_address=self.history_address,
            policy=self.policy, chunk_tokens=self.chunk_tokens, auth_tokens=self.auth_tokens,
            worker_tokens=self.worker_tokens, **self.tls,
            # in-process: health on the gRPC port only, and beats often (a killed worker is noticed in 3 s)
            **{"health_port": 0, "heartbeat_s": 1.0, **self.scheduler_settings}))
        self.stops.append(self._scheduler_stop)
        self.address = f"127.0.0.1:{port}"

    def kill_worker(self, worker_id: str) -> None:
        """Stops a worker abruptly (no draining), like a crashed pod."""
        server, _ = self.workers.pop(worker_id)
        if server.registration is not None:  # a dead process beats no more
            self.loop.call_soon_threadsafe(server.registration.cancel)
        self.run(server.server.stop(0))
        server.servicer.loop.stop()

    def stop(self) -> None:
        async def _stop():
            for _, stop in list(self.workers.values()):
                await stop()
            for stop in reversed(self.stops):
                await stop()
        self.run(_stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


async def _start_worker_advertised(settings, start_worker):
    """Binds port 0, then advertises the bound port (what a pod's IP + port would be)."""
    from services.rollout.settings import WorkerSettings

    from services.common.redis_server import free_port

    port = free_port()
    settings = WorkerSettings(**{**settings.model_dump(), "port": port, "advertise_address": f"127.0.0.1:{port}"})
    return await start_worker(settings)
