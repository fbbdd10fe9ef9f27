"""HistoryClient: what the scheduler and the rollout workers call to reach history.

It hides the protos: callers pass tuples and get :class:`Epoch` records with
numpy arrays. Errors surface as ``grpc.aio.AioRpcError`` with the service's
status (INVALID_ARGUMENT naming the field, UNAVAILABLE when Redis is down).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from rhymerl.v1 import history_pb2, history_pb2_grpc

from services.common.grpc_server import channel
from services.common.security import TLSConfig
from services.history.recent import RecentResponse
from services.history.records import Epoch

__all__ = ["Epoch", "HistoryClient", "RecentResponse"]


class HistoryClient:
    """An asyncio client of HistoryService at ``address`` ("host:port").

    Args:
        address: the service's address.
        timeout_s: deadline of each call.
    """

    def __init__(self, address: str, timeout_s: float = 30.0, tls: TLSConfig | None = None):
        self._channel = channel(address, tls)
        self._stub = history_pb2_grpc.HistoryServiceStub(self._channel)
        self.timeout_s = timeout_s

    async def put_rollouts(self, rollouts: Iterable[tuple[str, str, int, int, Sequence[int] | np.ndarray]]) -> int:
        """Stores (prompt_id, step_id, sample_index, policy_version, token_ids) rollouts.

        Returns the number newly stored; re-sending one is harmless and not counted.
        """
        request = history_pb2.PutRolloutsRequest()
        for prompt_id, step_id, sample_index, policy_version, token_ids in rollouts:
            # Filled in place: passing built messages to a constructor copies their tokens.
            rollout = request.rollouts.add(prompt_id=prompt_id, step_id=step_id, sample_index=sample_index,
                                           policy_version=policy_version)
            rollout.token_ids.extend(_as_list(token_ids))
        response = await self._stub.PutRollouts(request, timeout=self.timeout_s)
        return response.num_written

    async def put_rewards(self, rewards: Iterable[tuple[str, str, int, float]]) -> int:
        """Stores (prompt_id, step_id, sample_index, reward) beside the rollouts; returns the number new."""
        request = history_pb2.PutRewardsRequest(rewards=[
            history_pb2.RolloutReward(prompt_id=prompt_id, step_id=step_id, sample_index=sample_index,
                                      reward=reward)
            for prompt_id, step_id, sample_index, reward in rewards])
        response = await self._stub.PutRewards(request, timeout=self.timeout_s)
        return response.num_written

    async def get_history(self, prompt_ids: Sequence[str], max_epochs: int = 0,
                          include_tokens: bool = True) -> dict[str, list[Epoch]]:
        """The newest ``max_epochs`` epochs (0 = all kept) of each prompt, newest first.

        Every requested prompt is a key of the result (an empty list if it has
        no history). With ``include_tokens=False`` only lengths and rewards
        travel, and each epoch's ``responses`` is empty.
        """
        request = history_pb2.GetHistoryRequest(prompt_ids=prompt_ids, max_epochs=max_epochs,
                                                include_tokens=include_tokens)
        response = await self._stub.GetHistory(request, timeout=self.timeout_s)
        return {p.prompt_id: [_unpack_epoch(e) for e in p.epochs] for p in response.prompts}

    async def get_recent_responses(self, max_responses: int, max_tokens: int) -> list[RecentResponse]:
        """The newest stored responses to any prompt (newest first), at most
        ``max_responses`` of them and ``max_tokens`` tokens in all."""
        request = history_pb2.GetRecentResponsesRequest(max_responses=max_responses, max_tokens=max_tokens)
        response = await self._stub.GetRecentResponses(request, timeout=self.timeout_s)
        return [RecentResponse(r.prompt_id, r.step_id, r.sample_index, np.frombuffer(r.token_ids_le, dtype="<i4"))
                for r in response.responses]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "HistoryClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _as_list(token_ids: Sequence[int] | np.ndarray) -> Sequence[int]:
    return token_ids.tolist() if isinstance(token_ids, np.ndarray) else token_ids


def _unpack_epoch(epoch: history_pb2.EpochRollouts) -> Epoch:
    num_samples = len(epoch.sample_indices)
    rewards = (np.array(epoch.rewards, dtype=np.float32) if len(epoch.rewards)
               else np.full(num_samples, np.nan, dtype=np.float32))
    return Epoch(
        step_id=epoch.step_id,
        policy_version=epoch.policy_version,
        sample_indices=np.array(epoch.sample_indices, dtype=np.int32),
        lengths=np.array(epoch.lengths, dtype=np.int32),
        rewards=rewards,
        responses=_split_tokens(epoch.token_ids_le, epoch.lengths))


def _split_tokens(packed: bytes, lengths: Sequence[int]) -> list[np.ndarray]:
    """Per-sample int32 arrays (read-only views of one buffer) from the packed tokens."""
    if not packed:
        return []
    flat = np.frombuffer(packed, dtype="<i4")
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    if ends.size and ends[-1] != flat.size:
        raise ValueError(f"history reply holds {flat.size} tokens, its lengths sum to {int(ends[-1])}")
    return np.split(flat, ends[:-1])
