"""The step router process: RolloutService for trainers, in front of scheduler shards.

Trainers use it exactly as they use one scheduler (same service, same SDK). Steps are
split over the shards by prompt group (``core.py``); rewards and logprobs reports go to
the shard that produced each sample; weight pushes and loads go to every shard; stats
are summed. Readiness: RolloutService is SERVING while some shard can take work.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import aclosing
from dataclasses import replace

import grpc
from redis.exceptions import RedisError
from rhymerl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from services.common import metrics
from services.common.errors import FailedPrecondition, SettingError, Unavailable, grpc_errors
from services.common.grpc_server import Server, run_until_signal
from services.common.security import BearerTokenAuth, parse_tokens
from services.common.validation import check_id
from services.router.core import SHARD_FAULTS, LatestWeights, Router, Shard, ShardError, merge_mismatch
from services.router.registry import ShardDirectory
from services.router.settings import RouterSettings
from services.scheduler.weight_fanout import check_header
from services.scheduler.weight_store import WeightStore
from services.scheduler.intake import check_report_size, check_rewards

log = logging.getLogger(__name__)
ROLLOUT_SERVICE = "rhymerl.v1.RolloutService"


class RouterServicer(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self, router: Router):
        self.router = router

    @grpc_errors
    async def SubmitStep(self, request, context):
        step = await self.router.submit(request)
        async with aclosing(step.follow()) as events:  # closed with the call: the step counts it gone
            async for event in events:
                yield event

    @grpc_errors
    async def CancelStep(self, request, context):
        return rollout_pb2.CancelStepResponse(num_cancelled=await self.router.cancel(request.step_id))

    @grpc_errors
    async def ReportRewards(self, request, context):
        check_id(request.step_id, "step_id")  # then the step, and the report bounded by its size (rewards.py)
        step = self.router.get(request.step_id)
        check_report_size(len(request.rewards), step.num_samples)
        check_rewards(request)
        for i, r in enumerate(request.rewards):  # as a scheduler answers (services/scheduler/rewards.py)
            if (r.prompt_id, r.sample_index) not in step.delivered and step.has_sample(r.prompt_id, r.sample_index):
                raise FailedPrecondition(f"sample ({r.prompt_id!r}, {r.sample_index}) has not finished",
                                         f"rewards[{i}]")
        by_sub = self.router.owners(step, [(r.prompt_id, r.sample_index, f"rewards[{i}].prompt_id")
                                           for i, r in enumerate(request.rewards)])
        answers = await asyncio.gather(*(
            self.router.call_shard(sub.shard, "ReportRewards", rollout_pb2.ReportRewardsRequest(
                step_id=sub.sub_id, rewards=[request.rewards[i] for i in positions]))
            for sub, positions in by_sub.values()))
        return rollout_pb2.ReportRewardsResponse(num_recorded=sum(a.num_recorded for a in answers))

    @grpc_errors
    async def ReportLogprobs(self, request, context):
        step = self.router.get(request.step_id)
        self.router.check_logprobs_report(step, request)
        by_sub = self.router.owners(step, [(s.prompt_id, s.sample_index, f"samples[{i}].prompt_id")
                                           for i, s in enumerate(request.samples)])
        subs = list(by_sub.values())
        answers = await asyncio.gather(*(
            self.router.call_shard(sub.shard, "ReportLogprobs", rollout_pb2.ReportLogprobsRequest(
                step_id=sub.sub_id, samples=[request.samples[i] for i in positions]))
            for sub, positions in subs))
        for (sub, _), answer in zip(subs, answers):
            step.mismatch[sub.sub_id] = answer.step  # the shard's figures over its sub-step so far
        return rollout_pb2.ReportLogprobsResponse(step=merge_mismatch(list(step.mismatch.values())),
                                                  reported=merge_mismatch([a.reported for a in answers]))

    @grpc_errors
    async def PushWeights(self, request_iterator, context):
        """Streamed to every shard at once, and into the router's weight store as it passes
        (kept if some shard took it: a shard behind is caught up from there)."""
        async with self.router.weights_gate():
            shards = self._shards()
            queues = [asyncio.Queue(maxsize=4) for _ in shards]
            calls = [asyncio.create_task(self._push_one(shard, queue)) for shard, queue in zip(shards, queues)]
            header, incoming = None, None
            try:
                async for chunk in request_iterator:
                    if header is None:  # checked as a scheduler checks it, before the store names a file by it
                        await check_header(chunk)
                        header = chunk.header
                        if self.router.store.path(header.sha256.lower()) is None:
                            incoming = self.router.store.writer(header)
                    elif incoming is not None and not chunk.HasField("header"):
                        await incoming.write(chunk.data)
                    for queue, call in zip(queues, calls):
                        await _put(queue, chunk, call)
                for queue, call in zip(queues, calls):
                    await _put(queue, None, call)
                results = await asyncio.gather(*calls, return_exceptions=True)
                response = self._updated(shards, results, "push")
                if incoming is None or incoming.commit():  # a payload the shards took is complete
                    incoming = None
                    self.router.updated(LatestWeights(header.version, sha256=header.sha256.lower()))
                return response
            finally:
                for call in calls:
                    call.cancel()
                if incoming is not None:
                    incoming.discard()

    @grpc_errors
    async def LoadWeights(self, request, context):
        async with self.router.weights_gate():
            shards = self._shards()
            results = await asyncio.gather(*(shard.stub.LoadWeights(request, metadata=self.router.metadata)
                                             for shard in shards), return_exceptions=True)
            response = self._updated(shards, results, "load")
            self.router.updated(LatestWeights(request.version, path=request.path))
            return response

    def _shards(self) -> list[Shard]:
        shards = [s for s in self.router.shards.values() if not s.failed]
        if not shards:
            raise Unavailable("no scheduler shard is alive")
        return shards

    async def _push_one(self, shard: Shard, queue: asyncio.Queue) -> common_pb2.WeightUpdateResponse:
        async def chunks():
            while (chunk := await queue.get()) is not None:
                yield chunk

        return await shard.stub.PushWeights(chunks(), metadata=self.router.metadata)

    def _updated(self, shards: list[Shard], results: list, what: str) -> common_pb2.WeightUpdateResponse:
        """Every shard that took the update serves its version; one that did not keeps
        the old one and gets no steps until it is brought to the new one. The update
        fails only when no shard took it (with the shards' own status when they agree:
        a bad header, a stale version)."""
        done = [(s, r) for s, r in zip(shards, results) if isinstance(r, common_pb2.WeightUpdateResponse)]
        failed = [(s, r) for s, r in zip(shards, results) if not isinstance(r, common_pb2.WeightUpdateResponse)]
        for shard, result in done:
            shard.info = replace(shard.info, policy_version=result.version)
            shard.updated_at = time.monotonic()
        for shard, exc in failed:
            log.warning("weight %s: shard %s did not take it: %s", what, shard.info.shard_id, exc)
        if not done:
            errors = [exc for _, exc in failed if isinstance(exc, grpc.aio.AioRpcError)]
            codes = {e.code() for e in errors}
            if len(errors) == len(failed) and len(codes) == 1 and codes.isdisjoint(SHARD_FAULTS - {
                    grpc.StatusCode.FAILED_PRECONDITION}):
                raise ShardError(errors[0], failed[0][0].info.shard_id)
            raise Unavailable(f"no shard took the weight {what}: " + "; ".join(
                f"{s.info.shard_id}: {getattr(e, 'details', lambda: e)()}" for s, e in failed))
        return common_pb2.WeightUpdateResponse(version=max(r.version for _, r in done),
                                                num_workers_updated=sum(r.num_workers_updated for _, r in done))

    @grpc_errors
    async def GetStats(self, request, context):
        shards = list(self.router.shards.values())
        answers = await asyncio.gather(*(s.stub.GetStats(request, timeout=5.0, metadata=self.router.metadata)
                                         for s in shards), return_exceptions=True)
        out = rollout_pb2.ServiceStats(policy_version=self.router.version,
                                       num_steps_running=len(self.router.active),
                                       num_requests_queued=sum(len(s.queue) * s.n for s in self.router.active))
        for answer in answers:
            if isinstance(answer, rollout_pb2.ServiceStats):
                out.workers.extend(answer.workers)
                out.num_requests_queued += answer.num_requests_queued
                out.num_generated_tokens += answer.num_generated_tokens
                out.spec.num_verify_steps += answer.spec.num_verify_steps
                out.spec.num_draft_tokens += answer.spec.num_draft_tokens
                out.spec.num_accepted_tokens += answer.spec.num_accepted_tokens
        return out


async def _put(queue: asyncio.Queue, item, call: asyncio.Task) -> None:
    """Hands ``item`` to a shard's push unless that push already ended (failed)."""
    if call.done():
        return
    putter = asyncio.ensure_future(queue.put(item))
    await asyncio.wait({putter, call}, return_when=asyncio.FIRST_COMPLETED)
    if not putter.done():
        putter.cancel()


async def start_router(settings: RouterSettings):
    """Starts the router in this event loop; returns (server, port, router, stop coroutine fn)."""
    if not settings.registry_url:
        raise SettingError("registry_url", "the shard registry's Redis URL is required")
    directory = ShardDirectory(settings.registry_url, settings.key_prefix)
    router = Router(settings.window, settings.no_shard_timeout_s, settings.max_steps_retained, settings.tls(),
                    settings.shard_auth_token, settings.max_samples_retained, WeightStore(settings.weights_dir),
                    journal=directory, abandoned_step_timeout_s=settings.abandoned_step_timeout_s,
                    max_samples_in_flight=settings.max_samples_in_flight)
    try:
        router.resume(await directory.steps_in_flight(), settings.resubmit_wait_s)
    except (RedisError, OSError) as exc:
        log.warning("steps of a previous router unreadable: %s", exc)
    tokens = parse_tokens(settings.auth_tokens)
    if not tokens:
        log.warning("RolloutService accepts calls without a token (RHYMERL_ROUTER_AUTH_TOKENS is empty)")
    server = Server([(rollout_pb2_grpc.add_RolloutServiceServicer_to_server, RouterServicer(router))],
                    [ROLLOUT_SERVICE], tls=settings.tls(), health_port=settings.health_port,
                    interceptors=[BearerTokenAuth(tokens, [ROLLOUT_SERVICE])] if tokens else [])

    async def refresh() -> None:
        try:
            router.update_shards(await directory.scan())
        except (RedisError, OSError) as exc:  # keep serving with the shards known
            log.warning("shard registry unreadable: %s", exc)
        await router.probe_failed()
        router.expire_waiting()
        router.cancel_abandoned()
        router.catch_up()
        router.publish_usable()
        await server.set_service_serving(ROLLOUT_SERVICE, any(s.usable(router.version)
                                                              for s in router.shards.values()))

    async def refresh_loop() -> None:
        while True:
            await asyncio.sleep(settings.refresh_s)
            try:
                await refresh()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad round
                log.exception("router refresh failed")

    router.start()
    port = await server.start(settings.host, settings.port)
    await refresh()
    refresher = asyncio.create_task(refresh_loop())
    log.info("router listening on %s:%d with %d shards (registry %s, window %g)", settings.host, port,
             len(router.shards), settings.registry_url, settings.window)

    async def stop() -> None:
        refresher.cancel()
        await server.stop()
        await router.stop()
        await directory.close()

    return server, port, router, stop


async def serve(settings: RouterSettings) -> None:
    metrics.serve_metrics(settings.metrics_port)
    _, _, _, stop = await start_router(settings)
    await run_until_signal(stop)

