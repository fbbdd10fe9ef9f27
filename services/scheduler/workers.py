"""The scheduler's table of rollout workers: registration, health, their stubs."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
from rhymerl.v1 import worker_pb2, worker_pb2_grpc

from services.common import metrics
from services.common.grpc_server import channel
from services.common.security import TLSConfig
from services.scheduler.policies.base import WorkerState

log = logging.getLogger(__name__)


@dataclass
class WorkerHandle:
    worker_id: str
    address: str
    state: WorkerState
    stub: worker_pb2_grpc.WorkerServiceStub
    channel: grpc.aio.Channel
    policy_version: int = 0
    vocab_size: int = 0
    max_model_len: int = 0
    accepting: bool = True
    last_seen: float = field(default_factory=time.monotonic)

    @property
    def can_take_work(self) -> bool:
        return self.state.healthy and self.accepting


class WorkerTable:
    """Workers known to the scheduler, by id."""

    def __init__(self, timeout_s: float, tls: TLSConfig | None = None):
        self.timeout_s = timeout_s
        self.tls = tls
        self.workers: dict[str, WorkerHandle] = {}

    def add(self, worker_id: str, address: str, max_num_seqs: int, policy_version: int,
            vocab_size: int, max_model_len: int) -> WorkerHandle:
        old = self.workers.get(worker_id)
        if old is not None and old.address == address:
            old.state.healthy, old.accepting, old.last_seen = True, True, time.monotonic()
            old.policy_version, old.state.capacity = policy_version, max_num_seqs
            self._export()
            return old
        ch = channel(address, self.tls)
        handle = WorkerHandle(worker_id=worker_id, address=address,
                              state=WorkerState(worker_id=worker_id, capacity=max_num_seqs),
                              stub=worker_pb2_grpc.WorkerServiceStub(ch), channel=ch,
                              policy_version=policy_version, vocab_size=vocab_size,
                              max_model_len=max_model_len)
        self.workers[worker_id] = handle
        log.info("worker %s at %s registered (capacity %d)", worker_id, address, max_num_seqs)
        self._export()
        return handle

    async def probe(self, address: str) -> worker_pb2.WorkerStats:
        """Asks a worker (e.g. a statically configured one) for its stats."""
        ch = channel(address, self.tls)
        try:
            return await worker_pb2_grpc.WorkerServiceStub(ch).GetWorkerStats(
                worker_pb2.WorkerStatsRequest(), timeout=5)
        finally:
            await ch.close()

    def usable(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.can_take_work]

    def mark_unhealthy(self, worker_id: str) -> None:
        w = self.workers.get(worker_id)
        if w is not None and w.state.healthy:
            log.warning("worker %s marked unhealthy", worker_id)
            w.state.healthy = False
            self._export()

    async def remove(self, worker_id: str) -> WorkerHandle | None:
        w = self.workers.pop(worker_id, None)
        if w is not None:
            await w.channel.close()
            self._export()
        return w

    async def check(self, worker: WorkerHandle) -> bool:
        """One health poll; updates the worker's view. True when it answered."""
        try:
            stats = await worker.stub.GetWorkerStats(worker_pb2.WorkerStatsRequest(), timeout=5)
        except grpc.RpcError:
            return False
        worker.last_seen = time.monotonic()
        worker.policy_version, worker.accepting = stats.policy_version, stats.accepting
        if not worker.state.healthy:
            log.info("worker %s healthy again", worker.worker_id)
            worker.state.healthy = True
            self._export()
        return True

    async def close(self) -> None:
        await asyncio.gather(*(w.channel.close() for w in self.workers.values()))

    def _export(self) -> None:
        healthy = sum(w.state.healthy for w in self.workers.values())
        metrics.workers_registered.labels(healthy="true").set(healthy)
        metrics.workers_registered.labels(healthy="false").set(len(self.workers) - healthy)
