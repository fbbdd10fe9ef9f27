"""The history service process: a thin gRPC servicer over HistoryStore.

Each RPC unpacks its request into plain records, calls the store and packs
the answer; validation and Redis errors are raised by the store and mapped to
gRPC statuses by ``grpc_errors``.

Run it with ``python -m services.history.server`` (settings from RHYMERL_HISTORY_*).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import numpy as np
from rhymerl.v1 import history_pb2, history_pb2_grpc

from services.common import metrics
from services.common.errors import SettingError, Unavailable, grpc_errors
from services.common.grpc_server import Server, run_until_signal
from services.common.redis_server import EmbeddedRedis
from services.history.recent import RecentResponses, pack
from services.history.records import Epoch, Reward, Rollout
from services.history.settings import HistorySettings
from services.history.store import HistoryStore

log = logging.getLogger(__name__)

SERVICE_NAME = history_pb2.DESCRIPTOR.services_by_name["HistoryService"].full_name
READINESS_INTERVAL_S = 1.0


class HistoryServicer(history_pb2_grpc.HistoryServiceServicer):
    def __init__(self, store: HistoryStore, recent: RecentResponses | None = None):
        self.store = store
        self.recent = recent or RecentResponses(store.client, store.keys)

    @grpc_errors
    async def PutRollouts(self, request, context):
        metrics.history_requests.labels(method="PutRollouts").inc()
        rollouts = [Rollout(r.prompt_id, r.step_id, r.sample_index, r.policy_version, np.array(r.token_ids, "<i4"))
                    for r in request.rollouts]
        num_written = await self.store.put_rollouts(rollouts)
        if num_written:  # a wholly re-sent batch is not streamed twice
            await self.recent.push([pack(r.prompt_id, r.step_id, r.sample_index, r.token_ids) for r in rollouts])
        metrics.history_rollouts_written.inc(num_written)
        return history_pb2.PutRolloutsResponse(num_written=num_written)

    @grpc_errors
    async def PutRewards(self, request, context):
        metrics.history_requests.labels(method="PutRewards").inc()
        rewards = [Reward(r.prompt_id, r.step_id, r.sample_index, r.reward) for r in request.rewards]
        return history_pb2.PutRewardsResponse(num_written=await self.store.put_rewards(rewards))

    @grpc_errors
    async def GetHistory(self, request, context):
        metrics.history_requests.labels(method="GetHistory").inc()
        prompt_ids = list(request.prompt_ids)
        histories = await self.store.get_history(prompt_ids, request.max_epochs, request.include_tokens)
        metrics.history_prompts_looked_up.inc(len(prompt_ids))
        metrics.history_prompts_hit.inc(sum(1 for epochs in histories if epochs))
        # Filled in place: building sub-messages first and passing them to a
        # parent's constructor copies every token again at each level.
        response = history_pb2.GetHistoryResponse()
        for prompt_id, epochs in zip(prompt_ids, histories):
            prompt = response.prompts.add(prompt_id=prompt_id)
            for epoch in epochs:
                _fill_epoch(prompt.epochs.add(), epoch)
        return response


    @grpc_errors
    async def GetRecentResponses(self, request, context):
        metrics.history_requests.labels(method="GetRecentResponses").inc()
        found = await self.recent.read(request.max_responses, request.max_tokens)
        response = history_pb2.GetRecentResponsesResponse()
        for r in found:
            response.responses.add(prompt_id=r.prompt_id, step_id=r.step_id, sample_index=r.sample_index,
                                   token_ids_le=r.token_ids.tobytes())
        return response


def _fill_epoch(message: history_pb2.EpochRollouts, epoch: Epoch) -> None:
    message.step_id = epoch.step_id
    message.policy_version = epoch.policy_version
    message.sample_indices.extend(epoch.sample_indices.tolist())
    message.lengths.extend(epoch.lengths.tolist())
    if not np.isnan(epoch.rewards).all():
        message.rewards.extend(epoch.rewards.tolist())
    if epoch.responses:
        message.token_ids_le = b"".join(np.asarray(t, dtype="<i4").tobytes() for t in epoch.responses)


async def start_history(settings: HistorySettings) -> tuple[Server, int, Callable[[], Awaitable[None]]]:
    """Starts the service in this process (and a private redis-server if no URL is set).

    Returns:
        The server, its bound port, and ``cleanup``: stops the server, closes
        the store and stops the private redis-server.

    Raises:
        SettingError: the configured Redis did not answer within ``redis_start_wait_s``.
    """
    embedded = None
    url = settings.redis_url
    if not url:
        embedded = await asyncio.to_thread(EmbeddedRedis(unix=True).start)
        url = embedded.url
    store = HistoryStore.from_url(url, settings.keys(), settings.num_epochs, settings.redis_timeout_s)

    async def close_store() -> None:
        await store.close()
        if embedded:
            embedded.stop()

    try:
        await _wait_for_redis(store, settings.redis_start_wait_s)
        server = Server([(history_pb2_grpc.add_HistoryServiceServicer_to_server, HistoryServicer(store))],
                        [SERVICE_NAME], tls=settings.tls(), health_port=settings.health_port)
        port = await server.start(settings.host, settings.port)
    except BaseException:
        await close_store()
        raise

    readiness = asyncio.create_task(_follow_redis(server, store))

    async def cleanup() -> None:
        readiness.cancel()
        await server.stop()
        await close_store()

    log.info("history service on %s:%d (%s, K=%d)", settings.host, port, store.where, settings.num_epochs)
    return server, port, cleanup


async def _wait_for_redis(store: HistoryStore, wait_s: float) -> None:
    """Until Redis answers a PING, retried every second for up to ``wait_s``: a service
    started beside its Redis (compose, a chart's bundled one, a node restarting both) waits
    for it instead of exiting into a crash loop. A Redis that answers with an error (a
    wrong password) fails at once: waiting would not fix it."""
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            await store.ping()
            return
        except Unavailable as exc:
            if time.monotonic() >= deadline:
                raise SettingError("redis_url", f"Redis did not answer within {wait_s:g} s "
                                                f"(redis_start_wait_s): {exc}") from None
            if not said:
                log.warning("%s; waiting up to %g s for it (redis_start_wait_s)", exc, wait_s)
                said = True
        await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


async def _follow_redis(server: Server, store: HistoryStore) -> None:
    """Readiness follows Redis: HistoryService is NOT_SERVING while Redis does not answer
    (every call would fail); the process itself ("") stays SERVING: restarting it would
    not bring Redis back."""
    while True:
        try:
            await store.ping()
            ready = True
        except Exception:  # noqa: BLE001 - any failure to answer is "not ready"
            ready = False
        await server.set_service_serving(SERVICE_NAME, ready)
        await asyncio.sleep(READINESS_INTERVAL_S)


async def serve(settings: HistorySettings) -> None:
    """Runs the service until SIGTERM/SIGINT, then drains and cleans up."""
    _, _, cleanup = await start_history(settings)
    try:
        metrics.serve_metrics(settings.metrics_port)
    except BaseException:
        await cleanup()
        raise
    await run_until_signal(cleanup)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(HistorySettings()))
