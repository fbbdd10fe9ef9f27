"""Request building and retry policy shared by the sync and asyncio clients."""

from __future__ import annotations

import hashlib
import logging
import math
import numbers
import os
import random
import time
from collections.abc import Iterator, Sequence

import grpc

from rhymerl.types import (Prompt, Sample, SamplingParams, StepSummary, derived_prompt_id, event_samples,
                           proto_message)
from rhymerl.v1 import common_pb2, rollout_pb2

# Safe to retry: the step id makes a re-submitted step idempotent, and a weight
# push of a version already serving with the same checksum is acknowledged. Not
# RESOURCE_EXHAUSTED: it means the request is over a limit (samples in flight, message
# size), and re-sending the same request cannot fit it; it only adds load to a full service.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
WEIGHT_CHUNK_BYTES = 4 * 1024 * 1024
# Default bound of a whole push_weights call, retries included. A push first waits for the
# running steps (after_steps mode; each bounded by the client's timeout_s, 600 s by
# default), then streams the model and waits for the workers to load it (a 538 MB model:
# about 45 s on a loaded 2-core machine). Give more for multi-GB models on slow links.
PUSH_TIMEOUT_S = 1200.0
# Default of how long a call keeps re-sending while the service does not answer: long
# enough for a scheduler (or router) restarted by Kubernetes to be back with its workers
# (a new pod, its start, the workers' next heartbeat), so that a trainer rides through a
# rollout or a node drain instead of dying on its first UNAVAILABLE.
RETRY_WINDOW_S = 120.0
# Bound of the CancelStep an interrupted rollout sends (cancel_on_interrupt): short, since
# the user is waiting to stop, and never retried (a service that does not answer in time
# leaves the step running, as it would without the option).
INTERRUPT_CANCEL_TIMEOUT_S = 3.0
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    # A restarted scheduler is reconnected within seconds (gRPC's default backoff grows to
    # 120 s, failing every retry fast until it expires).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


def channel_target(address: str, *, token: str | None, tls: bool, root_certificates: bytes | None,
                   server_name: str | None) -> tuple[grpc.ChannelCredentials | None, list, tuple]:
    """(credentials or None for plaintext, channel options, per-call metadata).

    The token travels as ``authorization: Bearer <token>`` metadata on every call; over a
    plaintext channel only where the operator chose that (a trusted network, tests).
    """
    use_tls = tls or root_certificates is not None
    credentials = grpc.ssl_channel_credentials(root_certificates) if use_tls else None
    options = list(CHANNEL_OPTIONS)
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    metadata = (("authorization", f"Bearer {token}"),) if token else ()
    return credentials, options, metadata


def backoff_s(attempt: int, base_s: float = 0.2, cap_s: float = 5.0) -> float:
    """Exponential backoff with full jitter."""
    return random.uniform(0, min(cap_s, base_s * 2 ** attempt))


def is_retryable(err: grpc.RpcError) -> bool:
    return err.code() in RETRYABLE


log = logging.getLogger("rhymerl")


class Retry:
    """When a call that failed is sent again: after UNAVAILABLE or DEADLINE_EXCEEDED only,
    at most ``max_retries`` times in a row (None: no count), while the failures in a row
    have lasted less than ``window_s``, and never past ``deadline`` (``time.monotonic()``;
    None: none). A stream that delivered a new sample since its last failure starts a new
    run of failures (``progressed``): a step's stream rides through each restart on its own.
    Each re-send is logged (logger ``rhymerl``, WARNING) with the error and the time left."""

    def __init__(self, max_retries: int | None, window_s: float, deadline: float | None = None):
        self.max_retries, self.window_s, self.deadline = max_retries, window_s, deadline
        self.attempt = 0  # re-sends in this run of failures
        self.failing_since: float | None = None

    def progressed(self) -> None:
        self.attempt, self.failing_since = 0, None

    def pause(self, err: grpc.RpcError, what: str) -> float | None:
        """Seconds to wait before re-sending, or None when the call must not be re-sent."""
        if not is_retryable(err) or (self.max_retries is not None and self.attempt >= self.max_retries):
            return None
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
        pause = backoff_s(self.attempt)
        if now + pause - self.failing_since > self.window_s or (self.deadline is not None
                                                                 and now + pause >= self.deadline):
            return None
        self.attempt += 1
        log.warning("%s: %s (%s); sending it again in %.1f s (retrying for %.0f s more)", what, err.code().name,
                    err.details(), pause, self.window_s - (now - self.failing_since))
        return pause


def remaining_s(deadline: float) -> float:
    """The time left before ``deadline`` (``time.monotonic()``), as a gRPC timeout."""
    return max(deadline - time.monotonic(), 0.001)


def check_client_settings(address, timeout_s, max_retries, retry_window_s, push_timeout_s) -> None:
    """A client's settings, checked where it is made (ValueError / TypeError naming the
    argument): a timeout_s of 0, below it or NaN failed every call at once with
    DEADLINE_EXCEEDED, which the client then re-sent for its whole retry window."""
    if not isinstance(address, str) or not address:
        raise TypeError(f"address: must be a non-empty 'host:port' string, got {address!r:.80}")
    for name, value in (("timeout_s", timeout_s), ("push_timeout_s", push_timeout_s),
                        ("retry_window_s", retry_window_s)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name}: must be a number of seconds, got {type(value).__name__}")
        if not (math.isfinite(value) and (value > 0 or name == "retry_window_s" and value == 0)):
            raise ValueError(f"{name}: must be a finite number of seconds > 0, got {value}")
    if max_retries is not None and (isinstance(max_retries, bool) or not isinstance(max_retries, numbers.Integral)
                                    or max_retries < 0):
        raise ValueError(f"max_retries: must be None (no count) or an int >= 0, got {max_retries!r}")


def _expect(value, cls, field: str) -> None:
    if not isinstance(value, cls):
        kind = type(value)
        raise TypeError(f"{field}: must be a rhymerl.{cls.__name__}, got {kind.__module__}.{kind.__qualname__}")


def step_request(step_id: str, prompts: Sequence[Prompt], n: int, sampling: SamplingParams,
                 policy_version: int) -> rollout_pb2.SubmitStepRequest:
    """The SubmitStep request; a prompt without an id is sent under the id the service
    would derive from its tokens (``Prompt.resolved_id``), so every sample names a prompt
    the SDK knows, whatever the service's derivation (history keys and seeds are the
    same as for an unnamed prompt). Arguments of the wrong kind (a list of token ids
    where a Prompt goes, a dict for sampling) raise TypeError naming them, not an
    AttributeError about ``to_proto``."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts: must be a sequence of rhymerl.Prompt, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        _expect(p, Prompt, f"prompts[{i}]")
    _expect(sampling, SamplingParams, "sampling")
    messages = [p.to_proto(f"prompts[{i}]") for i, p in enumerate(prompts)]  # first: malformed tokens fail as before
    for message in messages:
        if not message.prompt_id:
            message.prompt_id = derived_prompt_id(message.token_ids)
    request = proto_message(rollout_pb2.SubmitStepRequest, "", step_id=step_id,
                            policy_version=policy_version, n=n)
    request.sampling.CopyFrom(sampling.to_proto())
    request.prompts.extend(messages)
    return request


def new_samples(event: rollout_pb2.StepEvent, seen: set[tuple[str, int]], call) -> list[Sample]:
    """What a SubmitStep event adds to a call: its samples not seen before (added to
    ``seen``, so a retried stream yields each once); a summary goes to ``call.summary``
    (the call's own state: a client's calls may overlap)."""
    if event.HasField("summary"):
        call.summary = StepSummary.from_proto(event.summary)
        return []
    fresh = []
    for message in event_samples(event):
        sample = Sample.from_proto(message)
        if sample.key not in seen:
            seen.add(sample.key)
            fresh.append(sample)
    return fresh


def _entries(values, field: str, shape: str):
    """The (prompt_id, sample_index, value) tuples of ``values``; TypeError naming the
    argument (or ``field[i]``) for anything else, instead of a bare unpacking error."""
    if values is None or isinstance(values, (str, bytes)):
        raise TypeError(f"{field}: must be an iterable of {shape}, got {type(values).__name__}")
    for i, entry in enumerate(values):
        try:
            prompt_id, sample_index, value = entry
        except (TypeError, ValueError):
            raise TypeError(f"{field}[{i}]: must be {shape}, got {entry!r:.80}") from None
        yield i, prompt_id, sample_index, value


def rewards_request(step_id: str, rewards) -> rollout_pb2.ReportRewardsRequest:
    request = proto_message(rollout_pb2.ReportRewardsRequest, "", step_id=step_id)
    for i, p, index, r in _entries(rewards, "rewards", "(prompt_id, sample_index, reward)"):
        if isinstance(r, (str, bytes)):  # float("1.0") would take it
            raise TypeError(f"rewards[{i}].reward: must be a number, got {type(r).__name__}")
        request.rewards.append(proto_message(rollout_pb2.SampleReward, f"rewards[{i}]", prompt_id=p,
                                             sample_index=index, reward=r))
    return request


def prompt_ids(request: rollout_pb2.SubmitStepRequest) -> list[str]:
    """The ids of a ``step_request``'s prompts, in request order (none empty)."""
    return [p.prompt_id for p in request.prompts]


def in_order(samples: list, ids: Sequence[str]) -> list:
    """Samples in the order of their prompt's id in ``ids`` (the request's, from
    ``prompt_ids``: an unnamed prompt's derived one included), then of sample_index."""
    position = {pid: i for i, pid in enumerate(ids)}
    return sorted(samples, key=lambda s: (position.get(s.prompt_id, len(position)), s.sample_index))


def logprobs_request(step_id: str, samples) -> rollout_pb2.ReportLogprobsRequest:
    request = proto_message(rollout_pb2.ReportLogprobsRequest, "", step_id=step_id)
    for i, p, index, lp in _entries(samples, "samples", "(prompt_id, sample_index, logprobs)"):
        try:
            logprobs = [float(x) for x in lp]
        except (TypeError, ValueError) as exc:
            raise TypeError(f"samples[{i}].logprobs: must be a sequence of numbers ({exc})") from None
        request.samples.append(proto_message(rollout_pb2.SampleLogprobs, f"samples[{i}]", prompt_id=p,
                                             sample_index=index, logprobs=logprobs))
    return request


def weight_header(version: int, data) -> common_pb2.WeightHeader:
    """A push's header, checked before its stream opens: an error raised inside the request
    stream reached the caller as gRPC's UNKNOWN "Exception iterating requests!"."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data: must be the safetensors payload as bytes, got {type(data).__name__}")
    return proto_message(common_pb2.WeightHeader, "", version=version, total_bytes=len(data),
                         sha256=hashlib.sha256(data).hexdigest())


def load_request(version: int, path) -> common_pb2.LoadWeightsRequest:
    """A LoadWeights request; ``path`` a str or an os.PathLike (a pathlib.Path)."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    return proto_message(common_pb2.LoadWeightsRequest, "", version=version, path=path)


def weight_chunks(version: int, data: bytes, chunk_bytes: int = WEIGHT_CHUNK_BYTES,
                  header: common_pb2.WeightHeader | None = None) -> Iterator[common_pb2.WeightChunk]:
    """A header (``weight_header``'s, unless given: a retried push reuses its SHA-256)
    followed by the payload in chunks."""
    yield common_pb2.WeightChunk(header=header if header is not None else weight_header(version, data))
    view = memoryview(data)
    for start in range(0, len(data), chunk_bytes):
        yield common_pb2.WeightChunk(data=bytes(view[start:start + chunk_bytes]))
