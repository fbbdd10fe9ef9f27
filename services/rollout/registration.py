"""A worker's membership of the fleet: it registers with the scheduler, keeps
re-registering for as long as it runs (registration is its heartbeat, at the interval
the scheduler names, so a restarted scheduler gets it back within one interval and a
dead worker is noticed within three), goes on beating while it drains (marked
draining), and leaves on SIGTERM.
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
    """Registers with the scheduler, and again every interval for as long as the worker
    runs (until cancelled): the interval the scheduler's answer names
    (``RHYMERL_SCHEDULER_HEARTBEAT_S``), or ``heartbeat_s`` until one answered. Each
    beat says whether the worker drains (``servicer.accepting`` false). Beats come
    early by up to a fifth of the interval, at random, so a fleet started at once does
    not beat at once. Unanswered attempts back off exponentially, with jitter, up to
    the interval; a beat may take two intervals to be answered (a scheduler busy with
    a huge step reads it late, and it still counts)."""
    request = worker_pb2.RegisterRequest(
        worker_id=servicer.worker_id, address=address, max_num_seqs=settings.max_num_seqs,
        vocab_size=servicer.config.vocab_size, max_model_len=servicer.config.max_position_embeddings)
    ch = channel(settings.scheduler_address, settings.tls())
    stub = worker_pb2_grpc.RegistryServiceStub(ch)
    failures, registered, interval = 0, False, settings.heartbeat_s
    try:
        while True:
            request.policy_version = servicer.version
            request.draining = not getattr(servicer, "accepting", True)
            try:
                response = await stub.Register(request, timeout=max(5.0, 2 * interval))
                if failures or not registered:
                    log.info("registered with scheduler %s as %s", settings.scheduler_address, servicer.worker_id)
                interval = response.heartbeat_s or settings.heartbeat_s
                registered, failures, delay = True, 0, interval * random.uniform(0.8, 1.0)
            except grpc.RpcError as err:
                failures += 1
                if failures == 1 or failures % 30 == 0:
                    log.info("scheduler %s not answering (%s); retrying", settings.scheduler_address, err.code())
                delay = min(interval, 0.05 * 2 ** min(failures, 10)) * random.uniform(0.5, 1.0)
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
