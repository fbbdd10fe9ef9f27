"""An in-process rhymerl: history (real redis-server), scheduler and workers on loopback gRPC."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from pathlib import Path

from services.rollout.models.config import ModelConfig

TINY = dict(architecture="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
            rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False, attention_bias=True,
            qk_norm=False, eos_token_ids=(1,), bos_token_id=None, dtype="float32")


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
    tls: dict = field(default_factory=dict)  # tls_* settings, given to every service
    auth_tokens: str = ""
    device: str = "cpu"  # "cuda": every worker shares the one GPU
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
        from services.scheduler.server import start_scheduler
        from services.scheduler.settings import SchedulerSettings

        _, history_port, stop = await start_history(
            HistorySettings(host="127.0.0.1", port=0, metrics_port=0, redis_url=self.redis_url, **self.tls))
        self.stops.append(stop)
        self.history_address = f"127.0.0.1:{history_port}"
        self.scheduler, port, stop = await start_scheduler(SchedulerSettings(
            host="127.0.0.1", port=0, metrics_port=0, history_address=self.history_address,
            policy=self.policy, chunk_tokens=self.chunk_tokens, auth_tokens=self.auth_tokens, **self.tls,
            **self.scheduler_settings))
        self.stops.append(stop)
        self.address = f"127.0.0.1:{port}"
        for i in range(self.num_workers):
            await self.add_worker(f"w{i}")
        while len(self.scheduler.dispatcher.workers.usable()) < self.num_workers:
            await asyncio.sleep(0.05)

    async def add_worker(self, worker_id: str):
        from services.rollout.server import start_worker
        from services.rollout.settings import WorkerSettings

        settings = WorkerSettings(host="127.0.0.1", port=0, metrics_port=0, id=worker_id,
                                  advertise_address="", model_path=str(self.model_dir), device=self.device,
                                  dtype="float32", max_num_seqs=32, num_kv_blocks=256, block_size=16,
                                  speculative=self.speculative, measure_cost=False, scheduler_address=self.address,
                                  history_address=self.history_address, drain_timeout_s=5, **self.tls)
        server, port, stop = await _start_worker_advertised(settings, start_worker)
        self.workers[worker_id] = (server, stop)
        return server

    def kill_worker(self, worker_id: str) -> None:
        """Stops a worker abruptly (no draining), like a crashed pod."""
        server, _ = self.workers.pop(worker_id)
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
