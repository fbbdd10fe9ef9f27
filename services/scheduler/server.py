"""The scheduler process: RolloutService for trainers, RegistryService for workers.

Thin transport: each method unpacks, calls the dispatcher, packs.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rhymerl.v1 import rollout_pb2, rollout_pb2_grpc, worker_pb2, worker_pb2_grpc

from services.common import metrics
from services.common.errors import InvalidArgument, NotFound, grpc_errors
from services.common.grpc_server import Server, run_until_signal
from services.common.security import BearerTokenAuth, parse_tokens
from services.scheduler.dispatcher import Dispatcher
from services.scheduler.mismatch import MismatchTracker
from services.scheduler.policies import make_policy, policy_options
from services.scheduler.settings import SchedulerSettings
from services.scheduler.weights import WeightFanout
from services.scheduler.workers import WorkerTable

log = logging.getLogger(__name__)
HEALTH_INTERVAL_S = 2.0


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, dispatcher: Dispatcher, weights: WeightFanout, history):
        self.dispatcher = dispatcher
        self.weights = weights
        self.history = history
        self.mismatch = MismatchTracker(dispatcher.steps)

    @grpc_errors
    async def SubmitStep(self, request, context):
        run = await self.dispatcher.submit(request)
        async for event in run.follow():
            yield event

    @grpc_errors
    async def CancelStep(self, request, context):
        return rollout_pb2.CancelStepResponse(num_cancelled=await self.dispatcher.cancel(request.step_id))

    @grpc_errors
    async def ReportRewards(self, request, context):
        run = self.dispatcher.steps.get(request.step_id)
        if run is None and not request.step_id:
            raise InvalidArgument("must be non-empty", "step_id")
        if run is not None:
            known = {(s.request.prompt_id, s.request.sample_index) for s in run.samples.values()}
            for i, r in enumerate(request.rewards):
                if (r.prompt_id, r.sample_index) not in known:
                    raise NotFound(f"no sample ({r.prompt_id!r}, {r.sample_index}) in step {request.step_id!r}",
                                   f"rewards[{i}]")
        if self.history is None:
            return rollout_pb2.ReportRewardsResponse(num_recorded=0)
        rows = [(r.prompt_id, request.step_id, r.sample_index, r.reward) for r in request.rewards]
        return rollout_pb2.ReportRewardsResponse(num_recorded=await self.history.put_rewards(rows))

    @grpc_errors
    async def ReportLogprobs(self, request, context):
        return self.mismatch.report(request)

    @grpc_errors
    async def PushWeights(self, request_iterator, context):
        return await self.weights.push(request_iterator)

    @grpc_errors
    async def LoadWeights(self, request, context):
        return await self.weights.load(request)

    @grpc_errors
    async def GetStats(self, request, context):
        d = self.dispatcher
        return rollout_pb2.ServiceStats(
            policy_version=d.policy_version,
            workers=[rollout_pb2.WorkerInfo(worker_id=w.worker_id, address=w.address, healthy=w.state.healthy,
                                            policy_version=w.policy_version, num_running=len(w.state.running))
                     for w in d.workers.workers.values()],
            num_steps_running=sum(not r.is_finished for r in d.steps.values()),
            num_requests_queued=d.policy.num_queued(), num_generated_tokens=d.num_generated_tokens,
            spec=d.spec)


class RegistryServicer(worker_pb2_grpc.RegistryServiceServicer):
    def __init__(self, dispatcher: Dispatcher):
        self.dispatcher = dispatcher

    @grpc_errors
    async def Register(self, request, context):
        for name in ("worker_id", "address"):
            if not getattr(request, name):
                raise InvalidArgument("must be non-empty", name)
        d = self.dispatcher
        if not d.workers.workers:
            d.resume(max(d.policy_version, request.policy_version))
        d.workers.add(request.worker_id, request.address, request.max_num_seqs or 1, request.policy_version,
                      request.vocab_size, request.max_model_len)
        d.wake()
        return worker_pb2.RegisterResponse(policy_version=d.policy_version)

    @grpc_errors
    async def Deregister(self, request, context):
        w = self.dispatcher.workers.workers.get(request.worker_id)
        if w is None:
            raise NotFound(f"unknown worker {request.worker_id!r}", "worker_id")
        # Draining: no new work; its running chunks finish and report as usual.
        w.accepting = False
        if not w.state.running:
            await self.dispatcher.workers.remove(request.worker_id)
        return worker_pb2.DeregisterResponse()


async def _watch_workers(dispatcher: Dispatcher, static: list[str], timeout_s: float) -> None:
    """Adds reachable static workers, polls health, drops workers silent too long."""
    table = dispatcher.workers
    while True:
        known = {w.address for w in table.workers.values()}
        for address in static:
            if address in known:
                continue
            try:
                stats = await table.probe(address)
            except Exception:  # noqa: BLE001 - not up yet
                continue
            table.add(stats.worker_id or address, address, stats.max_num_seqs or 1, stats.policy_version,
                      stats.vocab_size, stats.max_model_len)
            if len(table.workers) == 1:
                dispatcher.resume(max(dispatcher.policy_version, stats.policy_version))
        now = time.monotonic()
        for w in list(table.workers.values()):
            if await table.check(w):
                continue
            table.mark_unhealthy(w.worker_id)
            if w.state.running:
                dispatcher._requeue(w, list(w.state.running.values()))
            if now - w.last_seen > timeout_s or not w.accepting:
                log.warning("dropping worker %s", w.worker_id)
                await table.remove(w.worker_id)
        for w in list(table.workers.values()):
            if not w.accepting and not w.state.running:
                await table.remove(w.worker_id)
        dispatcher.abort_if_no_workers()
        dispatcher.wake()
        await asyncio.sleep(HEALTH_INTERVAL_S)


async def start_scheduler(settings: SchedulerSettings):
    """Starts the scheduler in this event loop; returns (server, port, stop coroutine fn)."""
    history = None
    if settings.history_address:
        from services.history.client import HistoryClient

        history = HistoryClient(settings.history_address, tls=settings.tls())
    policy_kwargs = {}
    options = policy_options(settings.policy)
    if settings.cross_step:
        if "cross_step" not in options:
            raise ValueError(f"cross_step needs a policy that supports it (rhymerl), not {settings.policy!r}")
        policy_kwargs["cross_step"] = True
    if settings.chunk_tokens and "chunk_size" in options:
        policy_kwargs["chunk_size"] = settings.chunk_tokens
    elif settings.chunk_tokens:
        log.info("policy %r runs whole requests; chunk_tokens=%d is not used", settings.policy,
                 settings.chunk_tokens)
    policy = make_policy(settings.policy, **policy_kwargs)
    if settings.record_events:
        from services.scheduler.simulator.replay import EventRecorder

        policy = EventRecorder(policy, settings.record_events, keep=False)
        log.info("recording scheduling events to %s", settings.record_events)
    table = WorkerTable(settings.worker_timeout_s, settings.tls())
    dispatcher = Dispatcher(policy, table, history, history_epochs=settings.history_epochs,
                            max_steps_retained=settings.max_steps_retained,
                            max_queued_samples=settings.max_queued_samples,
                            no_worker_timeout_s=settings.worker_timeout_s,
                            max_attempts=settings.max_attempts)
    dispatcher.start()
    server = Server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server,
                      RolloutServicer(dispatcher, WeightFanout(dispatcher), history)),
                     (worker_pb2_grpc.add_RegistryServiceServicer_to_server, RegistryServicer(dispatcher))],
                    ["rhymerl.v1.RolloutService", "rhymerl.v1.RegistryService"], tls=settings.tls(),
                    interceptors=_auth(settings), health_port=settings.health_port)
    port = await server.start(settings.host, settings.port)
    watcher = asyncio.create_task(_watch_workers(dispatcher, settings.static_workers(), settings.worker_timeout_s))
    log.info("scheduler listening on %s:%d (policy %s)", settings.host, port, settings.policy)

    async def stop() -> None:
        watcher.cancel()
        await server.stop()
        await dispatcher.stop()
        await table.close()
        if settings.record_events:
            policy.close()
        if history is not None:
            await history.close()

    server.dispatcher = dispatcher
    return server, port, stop


def _auth(settings: SchedulerSettings) -> list[BearerTokenAuth]:
    tokens = parse_tokens(settings.auth_tokens)
    if not tokens:
        log.warning("RolloutService accepts calls without a token (RHYMERL_SCHEDULER_AUTH_TOKENS is empty)")
        return []
    return [BearerTokenAuth(tokens, ["rhymerl.v1.RolloutService"])]


async def serve(settings: SchedulerSettings) -> None:
    metrics.serve_metrics(settings.metrics_port)
    _, _, stop = await start_scheduler(settings)
    await run_until_signal(stop)
