"""A worker's membership of the fleet: it registers with the scheduler and beats on
one stream (RegistryService.Heartbeat) for as long as it runs, at the interval the
scheduler names: a restarted scheduler gets it back within one interval (the stream
breaks, the worker opens another), a dead worker is noticed within three. It goes on
beating while it drains (marked draining), and leaves on SIGTERM. Every call carries
``authorization: Bearer <RHYMERL_WORKER_SCHEDULER_TOKEN>`` when that is set: a scheduler
with tokens registers and deregisters no worker without one.
"""

from __future__ import annotations

import asyncio
import logging
import random

import grpc
from rhymerl.v1 import worker_pb2, worker_pb2_grpc

from services.common.grpc_server import channel
from services.common.security import TLSConfig, token_metadata
from services.rollout.settings import WorkerSettings

log = logging.getLogger(__name__)


async def keep_registered(settings: WorkerSettings, servicer, address: str) -> None:
    """Registers with the scheduler and beats until cancelled: one Heartbeat stream,
    whose first message registers the worker; then a message every interval, the one
    the scheduler's answers name (``RHYMERL_SCHEDULER_HEARTBEAT_S``; ``heartbeat_s``
    until one answered). Each beat says whether the worker drains
    (``servicer.accepting`` false). Beats come early by up to a fifth of the interval,
    at random, so a fleet started at once does not beat at once. A stream that ends,
    breaks or goes unanswered (the first beat, two intervals) is opened again, backing
    off exponentially, with jitter, up to the interval. A scheduler without the stream
    (an older version, UNIMPLEMENTED) gets a Register call per beat instead."""
    request = worker_pb2.RegisterRequest(
        worker_id=servicer.worker_id, address=address, max_num_seqs=settings.max_num_seqs,
        vocab_size=servicer.config.vocab_size, max_model_len=servicer.max_model_len)
    ch = channel(settings.scheduler_address, settings.tls())
    stub = worker_pb2_grpc.RegistryServiceStub(ch)
    metadata = token_metadata(settings.scheduler_token)
    state = {"interval": settings.heartbeat_s}
    failures, registered = 0, False

    def beat() -> worker_pb2.RegisterRequest:
        request.policy_version = servicer.version
        request.draining = not getattr(servicer, "accepting", True)
        return request

    async def answers(call) -> None:
        """The scheduler's answers, until the stream ends (the interval may change)."""
        while (response := await call.read()) is not grpc.aio.EOF:
            state["interval"] = response.heartbeat_s or settings.heartbeat_s

    def heard(response: worker_pb2.RegisterResponse) -> None:
        nonlocal failures, registered
        state["interval"] = response.heartbeat_s or settings.heartbeat_s
        if failures or not registered:
            log.info("registered with scheduler %s as %s", settings.scheduler_address, servicer.worker_id)
        registered, failures = True, 0

    streams = True  # False: an older scheduler, without Heartbeat: a Register call per beat
    try:
        while True:
            call, reader = (stub.Heartbeat(metadata=metadata) if streams else None), None
            try:
                if call is None:
                    heard(await stub.Register(beat(), timeout=max(5.0, 2 * state["interval"]), metadata=metadata))
                    await asyncio.sleep(state["interval"] * random.uniform(0.8, 1.0))
                    continue
                await call.write(beat())
                first = await asyncio.wait_for(call.read(), max(5.0, 2 * state["interval"]))
                if first is grpc.aio.EOF:
                    raise ConnectionError("the scheduler ended the heartbeat stream")
                heard(first)
                reader = asyncio.ensure_future(answers(call))
                while True:
                    await asyncio.wait({reader}, timeout=state["interval"] * random.uniform(0.8, 1.0))
                    if reader.done():
                        reader.result()  # an error, or the end of the stream
                        raise ConnectionError("the scheduler ended the heartbeat stream")
                    await call.write(beat())
            except (grpc.RpcError, asyncio.TimeoutError, asyncio.InvalidStateError, ConnectionError) as err:
                if streams and isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("scheduler %s has no Heartbeat stream (an older version): a Register call per beat",
                             settings.scheduler_address)
                    streams = False
                    continue
                failures += 1
                if isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.UNAUTHENTICATED:
                    if failures == 1 or failures % 30 == 0:
                        log.warning("scheduler %s refused this worker's registration (UNAUTHENTICATED): "
                                    "RHYMERL_WORKER_SCHEDULER_TOKEN must be one of the scheduler's "
                                    "RHYMERL_SCHEDULER_WORKER_TOKENS (or AUTH_TOKENS); retrying",
                                    settings.scheduler_address)
                elif failures == 1 or failures % 30 == 0:
                    log.info("scheduler %s not answering (%s); retrying", settings.scheduler_address,
                             err.code() if isinstance(err, grpc.RpcError) else type(err).__name__)
                await asyncio.sleep(min(state["interval"], 0.05 * 2 ** min(failures, 10)) * random.uniform(0.5, 1.0))
            finally:
                if reader is not None:
                    reader.cancel()
                if call is not None:
                    call.cancel()
    finally:
        await ch.close()


async def deregister(address: str, worker_id: str, tls: TLSConfig | None = None, token: str = "") -> None:
    ch = channel(address, tls)
    try:
        await worker_pb2_grpc.RegistryServiceStub(ch).Deregister(
            worker_pb2.DeregisterRequest(worker_id=worker_id), timeout=5, metadata=token_metadata(token))
    except grpc.RpcError as err:
        log.warning("deregistration failed: %s", err.code())
    finally:
        await ch.close()
