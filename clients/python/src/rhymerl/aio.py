"""The asyncio client: the same calls as :class:`rhymerl.RolloutClient`, awaitable."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence

import grpc

from rhymerl import _calls
from rhymerl.types import Mismatch, Prompt, Sample, SamplingParams, ServiceStats, StepResult, StepSummary
from rhymerl.v1 import rollout_pb2, rollout_pb2_grpc


class AsyncStepStream(AsyncIterator[Sample]):
    """The samples of one submitted step as they finish (what ``submit_step`` returns), and
    that step's own ``summary`` once its stream has ended (None until then). Iterate it
    once with ``async for``; ``aclose()`` stops reading (the step goes on in the service).

    As an async context manager (``async with client.submit_step(...) as stream:``) a
    cancellation of the task anywhere in the block, the loop's own body included (an
    ``await`` there), cancels the step in the service (``cancel_on_interrupt``) before it
    goes on; the stream is closed at the block's end."""

    def __init__(self, client: "AsyncRolloutClient", request: rollout_pb2.SubmitStepRequest):
        self._client = client
        self.step_id = request.step_id
        self.summary: StepSummary | None = None
        self._cancel_sent = False
        self._samples = client._stream(request, self)

    def __aiter__(self) -> "AsyncStepStream":
        return self

    async def __anext__(self) -> Sample:
        return await self._samples.__anext__()

    async def aclose(self) -> None:
        await self._samples.aclose()

    async def __aenter__(self) -> "AsyncStepStream":
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None and issubclass(exc_type, (asyncio.CancelledError, KeyboardInterrupt)):
                await self._client._cancel_interrupted(self)
        finally:
            await self.aclose()


class AsyncRolloutClient:
    """asyncio twin of RolloutClient; create it inside a running event loop.

    Calls may run concurrently (``asyncio.gather``): each keeps its own state.
    ``cancel_on_interrupt`` (default True): a ``rollout`` (or a ``submit_step`` stream)
    whose task is cancelled while it waits for the service (``task.cancel()``,
    ``asyncio.wait_for``'s timeout, Ctrl-C under ``asyncio.run``) sends CancelStep for its
    step (best effort, within a few seconds), then lets the CancelledError go on; the
    trade-off with rejoining a step is ``RolloutClient``'s.
    """

    def __init__(self, address: str, *, timeout_s: float = 600.0, max_retries: int | None = None,
                 retry_window_s: float = _calls.RETRY_WINDOW_S,
                 token: str | None = None, tls: bool = False, root_certificates: bytes | None = None,
                 server_name: str | None = None, push_timeout_s: float = _calls.PUSH_TIMEOUT_S,
                 cancel_on_interrupt: bool = True):
        _calls.check_client_settings(address, timeout_s, max_retries, retry_window_s, push_timeout_s)
        self.address = address
        self.cancel_on_interrupt = cancel_on_interrupt
        self.timeout_s = timeout_s
        self.push_timeout_s = push_timeout_s
        self.max_retries = max_retries
        self.retry_window_s = retry_window_s
        credentials, options, self._metadata = _calls.channel_target(
            address, token=token, tls=tls, root_certificates=root_certificates, server_name=server_name)
        self._channel = (grpc.aio.secure_channel(address, credentials, options=options) if credentials
                         else grpc.aio.insecure_channel(address, options=options))
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)
        # The summary of the step whose stream ended last on this client (None before any);
        # concurrent calls each get their own step's from their StepResult / AsyncStepStream.
        self.last_summary: StepSummary | None = None

    def submit_step(self, step_id: str, prompts: Sequence[Prompt], n: int,
                    sampling: SamplingParams = SamplingParams(), policy_version: int = 0
                    ) -> AsyncStepStream:
        """Yields each sample once, in completion order (``async for``); once the stream has
        ended, the returned stream's ``summary`` is this step's (and ``last_summary`` too,
        unless another call's stream ended after it). A prompt sent without a prompt_id is
        known by the id derived from its tokens (``Prompt.resolved_id``), which its samples
        carry. ``policy_version``: as in ``RolloutClient.rollout``."""
        return AsyncStepStream(self, _calls.step_request(step_id, prompts, n, sampling, policy_version))

    async def _stream(self, request: rollout_pb2.SubmitStepRequest, call: AsyncStepStream) -> AsyncIterator[Sample]:
        """The step's samples, each once; its summary goes to ``call`` (this call's own state)."""
        seen: set[tuple[str, int]] = set()
        try:
            retry = self._retry()
            while True:
                events = self._stub.SubmitStep(request, timeout=self.timeout_s, metadata=self._metadata)
                try:
                    async for event in events:
                        for sample in _calls.new_samples(event, seen, call):
                            retry.progressed()
                            yield sample
                    break
                except grpc.RpcError as err:
                    pause = retry.pause(err, f"step {request.step_id!r}")
                    if pause is None:
                        raise
                finally:
                    events.cancel()  # a no-op once the stream has ended; else stops reading it
                await asyncio.sleep(pause)
        except asyncio.CancelledError:
            await self._cancel_interrupted(call)
            raise
        self.last_summary = call.summary  # one assignment: the step whose stream ended last

    async def _cancel_interrupted(self, call: AsyncStepStream) -> None:
        """CancelStep for a cancelled call's step (``cancel_on_interrupt``), once, best
        effort: a short deadline, no retry, an error ignored."""
        if not self.cancel_on_interrupt or call._cancel_sent:
            return
        call._cancel_sent = True
        try:
            await self._stub.CancelStep(rollout_pb2.CancelStepRequest(step_id=call.step_id),
                                        timeout=_calls.INTERRUPT_CANCEL_TIMEOUT_S, metadata=self._metadata)
        except Exception:  # noqa: BLE001 - best effort: an RPC error, a closed channel
            pass

    async def rollout(self, step_id: str, prompts: Sequence[Prompt], n: int,
                      sampling: SamplingParams = SamplingParams(), policy_version: int = 0) -> StepResult:
        """See ``RolloutClient.rollout``: the samples in the order of ``prompts`` (whatever
        their ids: an unnamed prompt is sent under its derived id), then of sample_index;
        this step's own summary, whatever runs beside it; ``policy_version`` the oldest
        policy accepted (a newer one may serve: each sample says which). A cancelled task
        cancels the step in the service first (``cancel_on_interrupt``)."""
        request = _calls.step_request(step_id, prompts, n, sampling, policy_version)
        call = AsyncStepStream(self, request)
        try:
            samples = [s async for s in call]
        except asyncio.CancelledError:
            await self._cancel_interrupted(call)
            raise
        ids = _calls.prompt_ids(request)
        return StepResult(samples=_calls.in_order(samples, ids), summary=call.summary, prompt_ids=ids)

    async def cancel_step(self, step_id: str) -> int:
        """See ``RolloutClient.cancel_step``."""
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
        header = _calls.weight_header(version, data)
        retry = self._retry(deadline)
        while True:
            try:
                chunks = _calls.weight_chunks(version, data, header=header)
                response = await self._stub.PushWeights(chunks, timeout=_calls.remaining_s(deadline),
                                                        metadata=self._metadata)
                return response.version
            except grpc.RpcError as err:
                pause = retry.pause(err, f"push of version {version}")
                if pause is None:
                    raise
                await asyncio.sleep(pause)

    async def load_weights(self, version: int, path: str) -> int:
        request = _calls.load_request(version, path)
        return (await self._call(self._stub.LoadWeights, request)).version

    async def stats(self) -> ServiceStats:
        return ServiceStats.from_proto(await self._call(self._stub.GetStats, rollout_pb2.GetStatsRequest()))

    async def _call(self, method, request):
        retry = self._retry()
        while True:
            try:
                return await method(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:
                pause = retry.pause(err, type(request).__name__.removesuffix("Request"))
                if pause is None:
                    raise
                await asyncio.sleep(pause)

    def _retry(self, deadline: float | None = None) -> _calls.Retry:
        return _calls.Retry(self.max_retries, self.retry_window_s, deadline)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncRolloutClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
