"""The asyncio client: the same calls as :class:`rhymerl.RolloutClient`, awaitable."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc

from rhymerl import _calls
from rhymerl.types import (Mismatch, Prompt, Sample, SamplingParams, ServiceStats, StepResult, StepSummary,
                           event_samples)
from rhymerl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


class AsyncRolloutClient:
    """asyncio twin of RolloutClient; create it inside a running event loop."""

    def __init__(self, address: str, *, timeout_s: float = 600.0, max_retries: int = 3,
                 token: str | None = None, tls: bool = False, root_certificates: bytes | None = None,
                 server_name: str | None = None, push_timeout_s: float = _calls.PUSH_TIMEOUT_S):
        self.address = address
        self.timeout_s = timeout_s
        self.push_timeout_s = push_timeout_s
        self.max_retries = max_retries
        credentials, options, self._metadata = _calls.channel_target(
            address, token=token, tls=tls, root_certificates=root_certificates, server_name=server_name)
        self._channel = (grpc.aio.secure_channel(address, credentials, options=options) if credentials
                         else grpc.aio.insecure_channel(address, options=options))
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)
        self.last_summary: StepSummary | None = None

    async def submit_step(self, step_id: str, prompts: Sequence[Prompt], n: int,
                          sampling: SamplingParams = SamplingParams(), policy_version: int = 0
                          ) -> AsyncIterator[Sample]:
        """Yields each sample once, in completion order; sets ``last_summary``. A prompt
        sent without a prompt_id is known by the id derived from its tokens
        (``Prompt.resolved_id``), which its samples carry."""
        async for sample in self._stream(_calls.step_request(step_id, prompts, n, sampling, policy_version)):
            yield sample

    async def _stream(self, request: rollout_pb2.SubmitStepRequest) -> AsyncIterator[Sample]:
        seen: set[tuple[str, int]] = set()
        self.last_summary = None
        for attempt in range(self.max_retries + 1):
            try:
                events = self._stub.SubmitStep(request, timeout=self.timeout_s, metadata=self._metadata)
                async for event in events:
                    if event.HasField("summary"):
                        self.last_summary = StepSummary.from_proto(event.summary)
                        continue
                    for message in event_samples(event):
                        sample = Sample.from_proto(message)
                        if sample.key not in seen:
                            seen.add(sample.key)
                            yield sample
                return
            except grpc.RpcError as err:
                if attempt == self.max_retries or not _calls.is_retryable(err):
                    raise
                await asyncio.sleep(_calls.backoff_s(attempt))

    async def rollout(self, step_id: str, prompts: Sequence[Prompt], n: int,
                      sampling: SamplingParams = SamplingParams(), policy_version: int = 0) -> StepResult:
        """See ``RolloutClient.rollout``: the samples in the order of ``prompts`` (whatever
        their ids: an unnamed prompt is sent under its derived id), then of sample_index."""
        request = _calls.step_request(step_id, prompts, n, sampling, policy_version)
        samples = [s async for s in self._stream(request)]
        ids = _calls.prompt_ids(request)
        return StepResult(samples=_calls.in_order(samples, ids), summary=self.last_summary, prompt_ids=ids)

    async def cancel_step(self, step_id: str) -> int:
        response = await self._call(self._stub.CancelStep, rollout_pb2.CancelStepRequest(step_id=step_id))
        return response.num_cancelled

    async def report_rewards(self, step_id: str, rewards: Iterable[tuple[str, int, float]]) -> int:
        return (await self._call(self._stub.ReportRewards, _calls.rewards_request(step_id, rewards))).num_recorded

    async def report_logprobs(self, step_id: str, samples: Iterable[tuple[str, int, Sequence[float]]]) -> Mismatch:
        """See ``RolloutClient.report_logprobs``."""
        response = await self._call(self._stub.ReportLogprobs, _calls.logprobs_request(step_id, samples))
        return Mismatch.from_proto(response.step)

    async def push_weights(self, version: int, data: bytes, *, timeout_s: float | None = None) -> int:
        """See ``RolloutClient.push_weights`` (bounded by ``timeout_s``, retries included)."""
        deadline = time.monotonic() + (self.push_timeout_s if timeout_s is None else timeout_s)
        sha256 = hashlib.sha256(data).hexdigest()
        for attempt in range(self.max_retries + 1):
            try:
                chunks = _calls.weight_chunks(version, data, sha256=sha256)
                response = await self._stub.PushWeights(chunks, timeout=_calls.remaining_s(deadline),
                                                        metadata=self._metadata)
                return response.version
            except grpc.RpcError as err:
                pause = _calls.pause_before_retry(err, attempt, self.max_retries, deadline)
                if pause is None:
                    raise
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    async def load_weights(self, version: int, path: str) -> int:
        request = common_pb2.LoadWeightsRequest(version=version, path=path)
        return (await self._call(self._stub.LoadWeights, request)).version

    async def stats(self) -> ServiceStats:
        return ServiceStats.from_proto(await self._call(self._stub.GetStats, rollout_pb2.GetStatsRequest()))

    async def _call(self, method, request):
        for attempt in range(self.max_retries + 1):
            try:
                return await method(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:
                if attempt == self.max_retries or not _calls.is_retryable(err):
                    raise
                await asyncio.sleep(_calls.backoff_s(attempt))
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncRolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
