"""A worker's membership of the fleet: it registers with the scheduler, keeps
re-registering for as long as it runs (registration is its heartbeat, so a restarted
scheduler gets it back within one interval), and leaves on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
import random

import grpc
from rhymerl.v1 import worker_pb2, worker_pb2_grpc

from services.common.grpc_server import channel
from services.common.security import TLSConfig
from services.rollout.settings import WorkerSettings

log = logging.getLogger(__name__)


async def keep_registered(settings: WorkerSettings, servicer, address: str) -> None:
    """Registers with the scheduler, and again every ``heartbeat_s`` for as long as the
    worker runs: a scheduler that restarted (and forgot its fleet) gets it back within
    one interval. Unanswered attempts back off exponentially, with jitter, up to it."""
    request = worker_pb2.RegisterRequest(
        worker_id=servicer.worker_id, address=address, max_num_seqs=settings.max_num_seqs,
        vocab_size=servicer.config.vocab_size, max_model_len=servicer.config.max_position_embeddings)
    ch = channel(settings.scheduler_address, settings.tls())
    stub = worker_pb2_grpc.RegistryServiceStub(ch)
    failures, registered = 0, False
    try:
        while True:
            request.policy_version = servicer.version
            try:
                await stub.Register(request, timeout=5)
                if failures or not registered:
                    log.info("registered with scheduler %s as %s", settings.scheduler_address, servicer.worker_id)
                registered, failures, delay = True, 0, settings.heartbeat_s
            except grpc.RpcError as err:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.info("scheduler %s not answering (%s); retrying", settings.scheduler_address, err.code())
                delay = min(settings.heartbeat_s, 0.05 * 2 ** min(failures, 10)) * random.uniform(0.5, 1.0)
            await asyncio.sleep(delay)
    finally:
        await ch.close()


async def deregister(address: str, worker_id: str, tls: TLSConfig | None = None) -> None:
    ch = channel(address, tls)
    try:
        await worker_pb2_grpc.RegistryServiceStub(ch).Deregister(
            worker_pb2.DeregisterRequest(worker_id=worker_id), timeout=5)
    except grpc.RpcError as err:
        log.warning("deregistration failed: %s", err.code())
    finally:
        await ch.close()
