"""The synchronous client a trainer uses: submit steps, stream samples, push weights."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import grpc

from rhymerl import _calls
from rhymerl.types import Mismatch, Prompt, Sample, SamplingParams, ServiceStats, StepResult, StepSummary
from rhymerl.v1 import rollout_pb2, rollout_pb2_grpc


class StepStream(Iterator[Sample]):
    """The samples of one submitted step as they finish (what ``submit_step`` returns), and
    that step's own ``summary`` once its stream has ended (None until then, or when the
    stream ended without one). Iterate it once; ``close()`` stops reading (the step goes
    on in the service: re-submitting its id rejoins it).

    As a context manager (``with client.submit_step(...) as stream: for s in stream: ...``)
    a KeyboardInterrupt anywhere in the block, the loop's own body included, cancels the
    step in the service (``cancel_on_interrupt``) before it goes on; the stream is closed
    at the block's end. Without ``with``, only an interrupt while the stream waits for the
    service does: one raised in the loop body never reaches the stream."""

    def __init__(self, client: "RolloutClient", request: rollout_pb2.SubmitStepRequest):
        self._client = client
        self.step_id = request.step_id
        self.summary: StepSummary | None = None
        self._cancel_sent = False
        self._samples = client._stream(request, self)

    def __iter__(self) -> "StepStream":
        return self

    def __next__(self) -> Sample:
        return next(self._samples)

    def close(self) -> None:
        self._samples.close()

    def __enter__(self) -> "StepStream":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
                self._client._cancel_interrupted(self)
        finally:
            self.close()


class RolloutClient:
    """Talks to the scheduler's RolloutService.

    Args:
        address: host:port of the scheduler.
        timeout_s: deadline of each call (a whole step's stream included); ``push_weights``
            has its own bound, ``push_timeout_s``.
        max_retries: re-sends after UNAVAILABLE / DEADLINE_EXCEEDED in a row, at most
            (None, the default: as many as ``retry_window_s`` allows; 0: none). Safe
            because step ids are idempotency keys (a re-submitted step replays its samples).
        retry_window_s: how long a call goes on re-sending (backoff from 0.2 s doubling to
            5 s, jittered) while the service does not answer: 120 s by default, so a
            trainer rides through a scheduler (or router) restarted by Kubernetes, which
            answers UNAVAILABLE until its workers have registered again. Each re-send is
            logged (logger ``rhymerl``, WARNING). A step's stream that got a new sample
            since its last failure has the whole window again for its next.
        token: bearer token, when the service requires one (UNAUTHENTICATED otherwise).
        tls: connect over TLS (system roots) ; implied by ``root_certificates``.
        root_certificates: PEM bytes of the CA that signed the service's certificate.
        server_name: the name to verify in the certificate, if not the address's host.
        push_timeout_s: default bound of a whole ``push_weights`` call, retries included
            (1200 s: it may first wait for the running steps, then streams and loads the model).
        cancel_on_interrupt: when a KeyboardInterrupt stops ``rollout`` (or ``submit_step``
            while it waits for the service), send CancelStep for its step (best effort,
            within a few seconds, never retried), then re-raise: the step's unfinished
            samples end as aborts and free their slots instead of running on for nobody.
            The trade-off: a trainer restarted with the same step id gets the samples that
            had finished replayed and the cancelled ones generated again, instead of
            finding them done. Other failures never cancel (UNAVAILABLE, DEADLINE_EXCEEDED
            after the retries, a process killed outright): the step runs on and
            re-submitting its id rejoins it; ``cancel_step`` gives a step up explicitly.
            False: an interrupted step also runs on, to be rejoined.

    One client may be shared by threads: each call keeps its own state (a step's summary
    is in its own ``StepResult`` / ``StepStream``).
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
        self._channel = (grpc.secure_channel(address, credentials, options=options) if credentials
                         else grpc.insecure_channel(address, options=options))
        self._stub = rollout_pb2_grpc.RolloutServiceStub(self._channel)
        # The summary of the step whose stream ended last on this client (None before
        # any): a convenience for one caller at a time. Calls that overlap (threads) each
        # get their own step's summary from their StepResult / StepStream instead.
        self.last_summary: StepSummary | None = None

    def submit_step(self, step_id: str, prompts: Sequence[Prompt], n: int,
                    sampling: SamplingParams = SamplingParams(), policy_version: int = 0
                    ) -> StepStream:
        """Yields each sample as it finishes (completion order); once the stream has
        ended, the returned ``StepStream``'s ``summary`` is this step's summary (and
        ``last_summary`` too, unless another call's stream ended after it).

        Each (prompt_id, sample_index) is yielded exactly once, also across retries. A
        prompt sent without a prompt_id is known by the id derived from its tokens
        (``Prompt.resolved_id``), which its samples carry. ``policy_version``: as in
        ``rollout``.
        """
        return StepStream(self, _calls.step_request(step_id, prompts, n, sampling, policy_version))

    def _stream(self, request: rollout_pb2.SubmitStepRequest, call: StepStream) -> Iterator[Sample]:
        """The step's samples, each once; its summary goes to ``call`` (this call's own
        state, never the client's: calls may overlap)."""
        seen: set[tuple[str, int]] = set()
        try:
            retry = self._retry()
            while True:
                events = self._stub.SubmitStep(request, timeout=self.timeout_s, metadata=self._metadata)
                try:
                    for event in events:
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
                time.sleep(pause)
        except KeyboardInterrupt:
            self._cancel_interrupted(call)
            raise
        self.last_summary = call.summary  # one assignment: the step whose stream ended last

    def _cancel_interrupted(self, call: StepStream) -> None:
        """CancelStep for an interrupted call's step (``cancel_on_interrupt``), once, best
        effort: a short deadline, no retry, an error ignored (the interrupt is what the
        caller gets)."""
        if not self.cancel_on_interrupt or call._cancel_sent:
            return
        call._cancel_sent = True
        try:
            self._stub.CancelStep(rollout_pb2.CancelStepRequest(step_id=call.step_id),
                                  timeout=_calls.INTERRUPT_CANCEL_TIMEOUT_S, metadata=self._metadata)
        except Exception:  # noqa: BLE001 - best effort: an RPC error, a closed channel
            pass

    def rollout(self, step_id: str, prompts: Sequence[Prompt], n: int,
                sampling: SamplingParams = SamplingParams(), policy_version: int = 0) -> StepResult:
        """Runs a whole step and returns every sample with the step's summary, in the
        order of ``prompts`` and, per prompt, of ``sample_index`` (``submit_step``
        yields them as they finish).

        The order holds whatever the prompt ids: a prompt with an empty ``prompt_id`` is
        sent under the id the service would derive from its tokens (``Prompt.resolved_id``),
        and its samples carry that id. To map results back to ``prompts``: the result's
        ``groups[i]`` are the samples of ``prompts[i]``, ``prompt_ids[i]`` its id (the key
        of ``by_prompt`` and the id ``report_rewards`` / ``report_logprobs`` take).

        The result's ``summary`` is this step's, also when other threads share the client.

        ``policy_version``: the oldest policy the trainer accepts; 0 (the default) takes
        whatever serves. A version above the one serving is FAILED_PRECONDITION (push it
        first); one below it is served by the current version, without an error, as an
        asynchronous (off-policy) trainer wants: every sample's ``policy_version`` says
        which version made it (``token_policy_versions`` per token, when a push landed
        mid-sample). ``stats().policy_version`` is the version serving.

        A KeyboardInterrupt cancels the step in the service first (``cancel_on_interrupt``)."""
        request = _calls.step_request(step_id, prompts, n, sampling, policy_version)
        call = StepStream(self, request)
        try:
            samples = list(call)
        except KeyboardInterrupt:
            self._cancel_interrupted(call)
            raise
        ids = _calls.prompt_ids(request)
        return StepResult(samples=_calls.in_order(samples, ids), summary=call.summary, prompt_ids=ids)

    def cancel_step(self, step_id: str) -> int:
        """Cancels a step: its unfinished samples end as aborts (``finish_reason``
        "abort"), freeing their slots; returns how many. Re-submitting the step id later
        replays its finished samples and generates the aborted ones again."""
        return self._call(self._stub.CancelStep, rollout_pb2.CancelStepRequest(step_id=step_id)).num_cancelled

    def report_rewards(self, step_id: str, rewards: Iterable[tuple[str, int, float]]) -> int:
        """Records (prompt_id, sample_index, reward) of finished samples."""
        return self._call(self._stub.ReportRewards, _calls.rewards_request(step_id, rewards)).num_recorded

    def report_logprobs(self, step_id: str, samples: Iterable[tuple[str, int, Sequence[float]]]) -> Mismatch:
        """Reports the trainer's own logprobs of a finished step's samples, as
        (prompt_id, sample_index, one logprob per token); returns the mismatch with the
        rollout's over every sample of the step reported so far (also exported as
        Prometheus metrics). Re-reporting a sample replaces its earlier report."""
        response = self._call(self._stub.ReportLogprobs, _calls.logprobs_request(step_id, samples))
        return Mismatch.from_proto(response.step)

    def push_weights(self, version: int, data: bytes, *, timeout_s: float | None = None) -> int:
        """Streams a safetensors payload to every worker; returns the version serving.

        The whole call, retries included, ends within ``timeout_s`` (default: the
        client's ``push_timeout_s``, 1200 s) with the version serving or an error
        (DEADLINE_EXCEEDED once the time is spent). Re-sends after UNAVAILABLE or a
        deadline are safe: the same version with the same bytes is acknowledged, and
        a push that fails leaves the previous version serving.
        """
        deadline = time.monotonic() + (self.push_timeout_s if timeout_s is None else timeout_s)
        header = _calls.weight_header(version, data)
        retry = self._retry(deadline)
        while True:
            try:
                chunks = _calls.weight_chunks(version, data, header=header)
                return self._stub.PushWeights(chunks, timeout=_calls.remaining_s(deadline),
                                              metadata=self._metadata).version
            except grpc.RpcError as err:
                pause = retry.pause(err, f"push of version {version}")
                if pause is None:
                    raise
                time.sleep(pause)

    def load_weights(self, version: int, path: str) -> int:
        """Makes every worker load a checkpoint from a path they can all read."""
        request = _calls.load_request(version, path)
        return self._call(self._stub.LoadWeights, request).version

    def stats(self) -> ServiceStats:
        return ServiceStats.from_proto(self._call(self._stub.GetStats, rollout_pb2.GetStatsRequest()))

    def _call(self, method, request):
        retry = self._retry()
        while True:
            try:
                return method(request, timeout=self.timeout_s, metadata=self._metadata)
            except grpc.RpcError as err:
                pause = retry.pause(err, type(request).__name__.removesuffix("Request"))
                if pause is None:
                    raise
                time.sleep(pause)

    def _retry(self, deadline: float | None = None) -> _calls.Retry:
        return _calls.Retry(self.max_retries, self.retry_window_s, deadline)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
