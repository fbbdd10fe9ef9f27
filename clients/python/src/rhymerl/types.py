"""Typed results of the SDK, and their conversion from/to the wire messages."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from rhymerl.v1 import common_pb2, rollout_pb2

FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "unspecified",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


LOGPROBS_MODES = {"raw": common_pb2.LOGPROBS_MODE_RAW, "processed": common_pb2.LOGPROBS_MODE_PROCESSED}


@dataclass(frozen=True)
class SamplingParams:
    """How each sample is drawn; temperature 0 is greedy. See common.proto.

    seed: None (the default) draws fresh noise every step, derived from the step id (a
    re-submitted step id gets the same samples back); an integer fixes every sample of
    a prompt in every step that passes it.
    logprobs_mode: "raw" (log softmax(logits / T) over the whole vocabulary, what a
    trainer recomputes) or "processed" (over the tokens top_k / top_p / min_p allow,
    the distribution actually sampled). docs/sampling.md has the details.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs: bool = True
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs_mode: str = "raw"

    def __post_init__(self) -> None:
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: {self.logprobs_mode!r} is not one of {sorted(LOGPROBS_MODES)}")

    def to_proto(self) -> common_pb2.SamplingParams:
        try:
            stop_token_ids = list(self.stop_token_ids)
        except TypeError:  # a single id (stop_token_ids=2): "'int' object is not iterable" named nothing
            raise TypeError(f"sampling.stop_token_ids: must be a sequence of token ids, got "
                            f"{type(self.stop_token_ids).__name__}") from None
        return proto_message(
            common_pb2.SamplingParams, "sampling",
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens, stop_token_ids=stop_token_ids, seed=self.seed,
            logprobs=self.logprobs, min_p=self.min_p, min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, logprobs_mode=LOGPROBS_MODES[self.logprobs_mode])


def proto_message(cls, field: str, **values):
    """``cls(**values)``; a value the message cannot hold (a negative seed, a token id past
    int32, a str where a number goes) raises the protobuf error with the field it was
    given for (e.g. ``sampling.seed: Value out of range: -1``; ``field`` "": the name alone),
    not the bare error."""
    try:
        return cls(**values)
    except (TypeError, ValueError):
        for name, value in values.items():
            try:
                cls(**{name: value})
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{field}.{name}: {exc}" if field else f"{name}: {exc}") from None
        raise


def derived_prompt_id(token_ids: Sequence[int]) -> str:
    """The id the service gives a prompt sent without one: ``"h"`` + the hex blake2b
    (12-byte digest) of its tokens as little-endian int32 (services/common/ids.py,
    ``prompt_id_from_tokens``). A pure function of the tokens, stable across runs."""
    data = struct.pack(f"<{len(token_ids)}i", *token_ids)
    return "h" + hashlib.blake2b(data, digest_size=12).hexdigest()


@dataclass(frozen=True)
class Prompt:
    """A prompt as token ids; prompt_id keys its history across epochs.

    prompt_id may be empty: the prompt is then known by the id derived from its tokens
    (``resolved_id``), which the SDK sends in its place; its samples, and the calls that
    name them (rewards, logprobs), carry that id.
    """

    prompt_id: str
    token_ids: list[int]

    @property
    def resolved_id(self) -> str:
        """The id the prompt's samples carry: ``prompt_id``, or when it is empty the one
        derived from the tokens (``derived_prompt_id``, the service's derivation)."""
        return self.prompt_id or derived_prompt_id(self.token_ids)

    def to_proto(self, field: str = "prompt") -> common_pb2.Prompt:
        return proto_message(common_pb2.Prompt, field, prompt_id=self.prompt_id, token_ids=list(self.token_ids))


def event_samples(event: rollout_pb2.StepEvent) -> list[rollout_pb2.SampleResult]:
    """The samples a SubmitStep event carries, in order: one (``sample``), several
    (``samples``, a batch) or none (the summary)."""
    kind = event.WhichOneof("event")
    if kind == "samples":
        return list(event.samples.samples)
    return [event.sample] if kind == "sample" else []


@dataclass(frozen=True)
class Sample:
    """One finished response of one prompt."""

    step_id: str
    prompt_id: str
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    policy_version: int
    token_policy_versions: list[int]
    num_draft_tokens: int
    num_accepted_tokens: int
    num_verify_steps: int
    num_migrations: int
    seed: int
    error: str = ""  # why the service gave the sample up (finish_reason "abort")

    @classmethod
    def from_proto(cls, m: rollout_pb2.SampleResult) -> "Sample":
        return cls(
            step_id=m.step_id, prompt_id=m.prompt_id, sample_index=m.sample_index,
            token_ids=list(m.token_ids), logprobs=list(m.logprobs),
            finish_reason=FINISH_REASONS.get(m.finish_reason, "unspecified"),
            policy_version=m.policy_version, token_policy_versions=list(m.token_policy_versions),
            num_draft_tokens=m.spec.num_draft_tokens, num_accepted_tokens=m.spec.num_accepted_tokens,
            num_verify_steps=m.spec.num_verify_steps, num_migrations=m.num_migrations, seed=m.seed,
            error=m.error)

    @property
    def key(self) -> tuple[str, int]:
        return (self.prompt_id, self.sample_index)


@dataclass(frozen=True)
class StepSummary:
    """Statistics of one step (the last event of a step's stream)."""

    step_id: str
    num_samples: int
    num_generated_tokens: int
    makespan_s: float
    bubble_ratio: float
    tail_time_s: float
    num_verify_steps: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_migrations: int
    worker_busy_s: dict[str, float]
    history_hit_rate: float
    policy: str

    @classmethod
    def from_proto(cls, m: rollout_pb2.StepSummary) -> "StepSummary":
        return cls(
            step_id=m.step_id, num_samples=m.num_samples, num_generated_tokens=m.num_generated_tokens,
            makespan_s=m.makespan_s, bubble_ratio=m.bubble_ratio, tail_time_s=m.tail_time_s,
            num_verify_steps=m.spec.num_verify_steps, num_draft_tokens=m.spec.num_draft_tokens,
            num_accepted_tokens=m.spec.num_accepted_tokens, num_migrations=m.num_migrations,
            worker_busy_s=dict(m.worker_busy_s), history_hit_rate=m.history_hit_rate, policy=m.policy)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 when nothing was drafted)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per verify step (1.0 without speculation)."""
        return self.num_generated_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


@dataclass
class StepResult:
    """All samples of a step, sorted by (prompt order, sample index), and its summary.

    ``prompt_ids``: the request's prompts' ids in request order (``Prompt.resolved_id``:
    for a prompt sent without an id, the one derived from its tokens), as the samples
    carry them. ``by_prompt``: the samples of each prompt by that id, in request order,
    each list by sample_index. ``groups``: the same lists by position, ``groups[i]`` the
    samples of ``prompts[i]``.
    """

    samples: list[Sample]
    summary: StepSummary | None = None
    by_prompt: dict[str, list[Sample]] = field(default_factory=dict)
    prompt_ids: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for s in self.samples:
            self.by_prompt.setdefault(s.prompt_id, []).append(s)
        for group in self.by_prompt.values():
            group.sort(key=lambda s: s.sample_index)

    @property
    def groups(self) -> list[list[Sample]]:
        """Per prompt of the request, by position: its samples by sample_index ([] for a
        prompt with none). Without ``prompt_ids`` (a result built by hand), the groups
        of ``by_prompt`` in its order."""
        if not self.prompt_ids:
            return list(self.by_prompt.values())
        return [self.by_prompt.get(pid, []) for pid in self.prompt_ids]


@dataclass(frozen=True)
class Mismatch:
    """How the trainer's logprobs differ from the rollout's (``RolloutClient.report_logprobs``).

    Per token, d = rollout logprob - trainer logprob: ``mean_abs_diff`` / ``max_abs_diff``
    of |d|, ``mean_log_ratio`` the mean of d (k1 estimate of KL(rollout || trainer)),
    ``kl`` the mean of exp(-d) - 1 + d (k3 estimate, >= 0, 0 when every token matches).
    """

    num_samples: int
    num_tokens: int
    num_identical_tokens: int
    mean_abs_diff: float
    max_abs_diff: float
    mean_log_ratio: float
    kl: float

    @classmethod
    def from_proto(cls, m: rollout_pb2.MismatchStats) -> "Mismatch":
        return cls(num_samples=m.num_samples, num_tokens=m.num_tokens, num_identical_tokens=m.num_identical_tokens,
                   mean_abs_diff=m.mean_abs_diff, max_abs_diff=m.max_abs_diff, mean_log_ratio=m.mean_log_ratio,
                   kl=m.kl)

    @property
    def bitwise_identical(self) -> bool:
        """Every compared token's logprob equal to the last bit (batch-invariant workers)."""
        return self.num_identical_tokens == self.num_tokens


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    address: str
    healthy: bool
    policy_version: int
    num_running: int


@dataclass(frozen=True)
class ServiceStats:
    policy_version: int
    workers: list[WorkerInfo]
    num_steps_running: int
    num_requests_queued: int
    num_generated_tokens: int

    @classmethod
    def from_proto(cls, m: rollout_pb2.ServiceStats) -> "ServiceStats":
        return cls(
            policy_version=m.policy_version,
            workers=[WorkerInfo(w.worker_id, w.address, w.healthy, w.policy_version, w.num_running)
                     for w in m.workers],
            num_steps_running=m.num_steps_running, num_requests_queued=m.num_requests_queued,
            num_generated_tokens=m.num_generated_tokens)
