"""The scheduler process: RolloutService for trainers, RegistryService for workers.

Thin transport: each method unpacks, calls the core (or the weight fan-out, the rewards
check), packs. Readiness: RolloutService is SERVING only while some worker can serve;
the process itself ("") stays SERVING while it runs (liveness). Both are answered on
the gRPC port and, never waiting for this process's busy event loop, by its health
process on ``health_port`` (``services/common/health_process.py``), which the probes ask.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from rhymerl.v1 import rollout_pb2, rollout_pb2_grpc, worker_pb2, worker_pb2_grpc

from services.common import metrics
from services.common.errors import InvalidArgument, NotFound, SettingError, grpc_errors
from services.common.gc_tuning import tune_gc
from services.common.grpc_server import Server, raw_responses, run_until_signal
from services.common.health_process import HealthProcess
from services.common.security import BearerTokenAuth, parse_tokens
from services.common.validation import check_host_port, check_id
from services.scheduler.core import CoreLimits, SchedulerCore
from services.scheduler.mismatch import MismatchTracker
from services.scheduler.policies import make_policy, policy_options
from services.scheduler.rewards import record_rewards
from services.scheduler.settings import SchedulerSettings
from services.scheduler.step_log import StepLog
from services.scheduler.step_table import StepTable
from services.scheduler.watchdog import Watchdog
from services.scheduler.weight_fanout import WeightFanout
from services.scheduler.weight_store import WeightStore
from services.scheduler.worker_link import GrpcWorkerLink
from services.scheduler.workers import WorkerTable

log = logging.getLogger(__name__)
ROLLOUT_SERVICE = "rhymerl.v1.RolloutService"
REGISTRY_SERVICE = "rhymerl.v1.RegistryService"
# What a registration may claim. A worker's limits become the fleet's (the smallest over
# the workers bounds every step: intake.Fleet), so one absurd registration would refuse
# every step; no model a worker serves is this small, and none runs this many sequences.
MIN_VOCAB_SIZE = 16
MIN_MODEL_LEN = 16
MAX_NUM_SEQS = 65_536


class RolloutServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, core: SchedulerCore, weights: WeightFanout):
        self.core = core
        self.weights = weights
        self.mismatch = MismatchTracker(core.steps)

    @grpc_errors
    async def SubmitStep(self, request, context):
        """Streams the step's events as they are kept, serialized (``raw_responses``), the
        samples ready together in one batch."""
        run = await self.core.submit(request)
        async with aclosing(run.follow_batched()) as events:  # closed with the call: the step counts it gone
            async for event in events:
                yield event

    @grpc_errors
    async def CancelStep(self, request, context):
        return rollout_pb2.CancelStepResponse(num_cancelled=await self.core.cancel(request.step_id))

    @grpc_errors
    async def ReportRewards(self, request, context):
        num = await record_rewards(request, self.core, self.core.history)
        return rollout_pb2.ReportRewardsResponse(num_recorded=num)

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
        c = self.core
        return rollout_pb2.ServiceStats(
            policy_version=c.policy_version,
            workers=[rollout_pb2.WorkerInfo(worker_id=w.worker_id, address=w.address, healthy=w.state.healthy,
                                            policy_version=w.policy_version, num_running=len(w.state.running))
                     for w in c.workers.workers.values()],
            num_steps_running=sum(not r.is_finished for r in c.steps), num_requests_queued=c.policy.num_queued(),
            num_generated_tokens=c.num_generated_tokens, spec=c.delivery.spec_totals)


class RegistryServicer(worker_pb2_grpc.RegistryServiceServicer):
    def __init__(self, core: SchedulerCore, weights: WeightFanout, watchdog: Watchdog):
        self.core, self.weights, self.watchdog = core, weights, watchdog

    @grpc_errors
    async def Register(self, request, context):
        return await self._beat(request)

    @grpc_errors
    async def Heartbeat(self, request_iterator, context):
        """A worker's beats on one stream: each a Register, answered when the answer changed."""
        answered = None
        async for request in request_iterator:
            response = await self._beat(request)
            if (response.policy_version, response.heartbeat_s) != answered:
                answered = (response.policy_version, response.heartbeat_s)
                yield response

    async def _beat(self, request: worker_pb2.RegisterRequest) -> worker_pb2.RegisterResponse:
        """A registration, or a heartbeat: O(1) (``workers.py``)."""
        check_registration(request)
        w = self.core.register(request.worker_id, request.address, request.max_num_seqs or 1,
                               request.policy_version, request.vocab_size, request.max_model_len,
                               draining=request.draining)
        if w is not None and w.policy_version < self.core.policy_version:
            self.core.spawn(self.weights.catch_up(w))
        await self.watchdog.refresh()
        return worker_pb2.RegisterResponse(policy_version=self.core.policy_version,
                                           heartbeat_s=self.watchdog.heartbeat_s)

    @grpc_errors
    async def Deregister(self, request, context):
        w = self.core.workers.workers.get(request.worker_id)
        if w is None:
            raise NotFound(f"unknown worker {request.worker_id!r}", "worker_id")
        self.core.workers.stop_accepting(w)  # draining: no new work; its running chunks finish and report
        if not w.state.running:
            await self.watchdog.remove(w, "deregistered")
        await self.watchdog.refresh()
        return worker_pb2.DeregisterResponse()


def check_registration(request: worker_pb2.RegisterRequest) -> None:
    """Raises InvalidArgument naming the field of a registration that cannot be a worker's.
    0 in max_num_seqs (taken as 1), vocab_size and max_model_len (unknown: not checked)
    is what an older worker sends."""
    check_id(request.worker_id, "worker_id")
    check_host_port(request.address, "address")
    if not 0 <= request.max_num_seqs <= MAX_NUM_SEQS:
        raise InvalidArgument(f"must be in [1, {MAX_NUM_SEQS}] (or 0: 1), got {request.max_num_seqs}",
                              "max_num_seqs")
    if request.vocab_size and request.vocab_size < MIN_VOCAB_SIZE:
        raise InvalidArgument(f"must be at least {MIN_VOCAB_SIZE} (or 0: unknown), got {request.vocab_size}",
                              "vocab_size")
    if request.max_model_len and request.max_model_len < MIN_MODEL_LEN:
        raise InvalidArgument(f"must be at least {MIN_MODEL_LEN} (or 0: unknown), got {request.max_model_len}",
                              "max_model_len")
    if request.policy_version < 0:
        raise InvalidArgument(f"must be >= 0, got {request.policy_version}", "policy_version")


def _policy(settings: SchedulerSettings):
    kwargs = {}
    options = policy_options(settings.policy)
    if settings.cross_step:
        if "cross_step" not in options:
            raise ValueError(f"cross_step needs a policy that supports it (rhymerl), not {settings.policy!r}")
        kwargs["cross_step"] = True
    if settings.chunk_tokens and "chunk_size" in options:
        kwargs["chunk_size"] = settings.chunk_tokens
    elif settings.chunk_tokens:
        log.info("policy %r runs whole requests; chunk_tokens=%d is not used", settings.policy, settings.chunk_tokens)
    policy = make_policy(settings.policy, **kwargs)
    if settings.record_events:
        from services.scheduler.event_log import EventRecorder

        try:
            policy = EventRecorder(policy, settings.record_events, keep=False)
        except OSError as exc:
            raise SettingError("record_events", f"record_events {settings.record_events!r} cannot be written: "
                                                f"{exc.strerror or exc}") from None
        log.info("recording scheduling events to %s", settings.record_events)
    return policy


async def start_scheduler(settings: SchedulerSettings):
    """Starts the scheduler in this event loop; returns (server, port, stop coroutine fn)."""
    history = None
    if settings.history_address:
        from services.history.client import HistoryClient

        history = HistoryClient(settings.history_address, tls=settings.tls())
    policy = _policy(settings)
    link = GrpcWorkerLink(settings.tls())
    core = SchedulerCore(
        policy, WorkerTable(), link, history=history,
        steps=StepTable(settings.max_steps_retained, settings.max_retained_bytes),
        step_log=StepLog(settings.redis_url, ttl_s=settings.step_log_ttl_s, hold_s=settings.step_log_hold_s,
                         key_prefix=settings.key_prefix,
                         shard_id=settings.shard_id if settings.shard_registry_url else ""),
        limits=CoreLimits(max_samples_in_flight=settings.max_samples_in_flight, max_attempts=settings.max_attempts,
                          no_worker_timeout_s=settings.worker_timeout_s, history_epochs=settings.history_epochs,
                          fair_share=settings.fair_share, history_timeout_s=settings.history_timeout_s,
                          abandoned_step_timeout_s=settings.abandoned_step_timeout_s))
    weights = WeightFanout(core, settings.weight_updates, WeightStore(settings.weights_dir),
                           stall_s=settings.weight_push_stall_s)
    await weights.restore()
    server_box: list[Server] = []

    async def set_ready(ready: bool) -> None:
        if server_box:
            await server_box[0].set_service_serving(ROLLOUT_SERVICE, ready)

    watchdog = Watchdog(core, weights, settings.static_workers(), settings.worker_timeout_s, set_ready,
                        settings.heartbeat_s)
    services = [ROLLOUT_SERVICE, REGISTRY_SERVICE]
    server = Server([(raw_responses(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, ["SubmitStep"]),
                      RolloutServicer(core, weights)),
                     (worker_pb2_grpc.add_RegistryServiceServicer_to_server,
                      RegistryServicer(core, weights, watchdog))],
                    services, tls=settings.tls(), interceptors=_auth(settings))
    server_box.append(server)
    health = None
    if settings.health_port:  # health off the event loop (health_process.py), before anything is SERVING
        health = HealthProcess(settings.host, settings.health_port, ["", *services], settings.liveness_stall_s)
        server.health_port = await health.start()
        server.mirrors.append(health)
    core.start()
    port = await server.start(settings.host, settings.port)
    await watchdog.refresh()
    watcher = asyncio.create_task(watchdog.run())
    announcer = None
    if settings.shard_registry_url:  # a shard behind the step router (services/router/)
        from services.router.registry import ShardAnnouncer, advertised_address

        announcer = ShardAnnouncer(core, settings.shard_registry_url, settings.shard_id,
                                   advertised_address(settings.host, port, settings.shard_address), settings.shard_ttl_s,
                                   settings.key_prefix)
        announcer.start()
    log.info("scheduler listening on %s:%d (policy %s, weight updates %s, step log %s, heartbeat %g s, health "
             "port %s)", settings.host, port, settings.policy, settings.weight_updates,
             "on" if core.log.enabled else "off", settings.heartbeat_s, server.health_port or "none")

    async def stop() -> None:
        if health is not None:
            health.stopping()  # its child may die before it (a signal to the process group): no restart, no error
        if announcer is not None:
            await announcer.stop()
        watcher.cancel()
        await server.stop()
        if health is not None:
            await health.stop()
        await core.stop()
        await link.close()
        await core.log.shutdown()
        weights.store.close()
        if settings.record_events:
            policy.close()
        if history is not None:
            await history.close()

    server.core = core
    return server, port, stop


def _auth(settings: SchedulerSettings) -> list[BearerTokenAuth]:
    """RolloutService asks the trainers' tokens (auth_tokens); RegistryService the workers'
    (worker_tokens), or where none are set the trainers': a scheduler with tokens never
    lets an anonymous caller register a worker or deregister one."""
    tokens = parse_tokens(settings.auth_tokens)
    worker_tokens = parse_tokens(settings.worker_tokens) or tokens
    interceptors = []
    if tokens:
        interceptors.append(BearerTokenAuth(tokens, [ROLLOUT_SERVICE]))
    else:
        log.warning("RolloutService accepts calls without a token (RHYMERL_SCHEDULER_AUTH_TOKENS is empty)")
    if worker_tokens:
        interceptors.append(BearerTokenAuth(worker_tokens, [REGISTRY_SERVICE]))
    else:
        log.warning("RegistryService registers and deregisters workers without a token "
                    "(RHYMERL_SCHEDULER_WORKER_TOKENS and RHYMERL_SCHEDULER_AUTH_TOKENS are empty)")
    return interceptors


async def serve(settings: SchedulerSettings) -> None:
    metrics.serve_metrics(settings.metrics_port)
    _, _, stop = await start_scheduler(settings)
    tune_gc(settings.gc_threshold_values())
    await run_until_signal(stop)
