"""The placement-policy interface shared by the live scheduler and the simulator.

A policy decides which queued request runs next, on which worker, and for how many
tokens (its chunk budget). It knows nothing about gRPC, clocks or engines: the caller
(the live scheduler in ``services/scheduler``, or ``services.scheduler.simulator``)
feeds it events and applies the assignments it returns.

Who writes what: the policy updates the ``Request`` fields (``num_generated``,
``predicted_len``, ``last_worker``, ``num_chunks``, ``num_migrations``, ``is_probe``);
the caller updates ``WorkerState.running`` and ``healthy``. The caller's contract:
  1. ``add_step(requests, lengths, now)`` when a step's requests arrive, or
     ``add_step_in_slices`` (the same, done in slices, the caller free to serve other
     events between them; it may stop between slices after ``cancel_step``);
  2. ``schedule(workers, now, quota)`` after every event; the caller puts each returned
     assignment's request into ``workers[...].running`` (keyed by ``request.key``) and
     sends the chunk; ``quota`` (optional) caps the chunks each step may start in this
     call: the caller's fair share of the fleet between steps;
  3. ``on_chunk_done(request, worker_id, num_new_tokens, finished, now)`` when a chunk
     ends, after the caller removed the request from ``worker.running``; the policy adds
     ``num_new_tokens`` to ``num_generated``; unfinished requests go back to its pool;
  4. ``on_worker_lost(worker_id, requests, now)`` with the requests that were running
     there, after the caller marked the worker unhealthy and emptied its ``running``;
     their partial chunk is discarded (the engine regenerates it identically from the
     seed), so ``num_generated`` keeps the count of the last completed chunk;
  5. ``cancel_step(step_id)`` removes that step's queued requests and returns them;
     its running requests are the caller's to abort (their chunk results are ignored).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, NamedTuple

if TYPE_CHECKING:
    from services.scheduler.length_model import LengthModel


class RequestKey(NamedTuple):
    """Who a request is: sample ``sample_index`` of prompt ``prompt_id`` in step ``step_id``.

    A tuple, never a joined string: ids are the trainer's and may contain any
    separator ("X/a" + "b" and "X" + "a/b" are different requests).
    """

    step_id: str
    prompt_id: str
    sample_index: int


@dataclass(eq=False, slots=True)
class Request:
    """One sample of a step; mutable bookkeeping owned by the scheduler."""

    step_id: str
    prompt_id: str
    sample_index: int
    prompt_len: int
    max_tokens: int
    num_generated: int = 0  # tokens generated so far, all chunks together
    predicted_len: float | None = None  # predicted total response length (tokens)
    last_worker: str | None = None  # where its previous chunk ran
    num_chunks: int = 0
    num_migrations: int = 0
    is_probe: bool = False
    aborted: bool = False  # ended without a natural finish: its length says nothing
    key: RequestKey = field(init=False)
    # its place in arrival order while a policy's StepBook holds it unfinished, else -1
    # (a field, not a dict entry per request: steps.py)
    arrival: int = field(default=-1, init=False, repr=False)

    def __post_init__(self) -> None:
        self.key = RequestKey(self.step_id, self.prompt_id, self.sample_index)

    @property
    def group_id(self) -> tuple[str, str]:
        return (self.step_id, self.prompt_id)

    @property
    def num_remaining(self) -> int:
        """Most tokens it may still generate."""
        return self.max_tokens - self.num_generated


@dataclass
class WorkerState:
    """The scheduler's view of one worker."""

    worker_id: str
    capacity: int  # most requests it runs at once
    running: dict[RequestKey, Request] = field(default_factory=dict)
    healthy: bool = True

    @property
    def free(self) -> int:
        return max(0, self.capacity - len(self.running)) if self.healthy else 0


class Assignment(NamedTuple):
    """A chunk to run (immutable; a tuple: made once per chunk, where a frozen
    dataclass's ``__init__`` costs several times more)."""

    request: Request
    worker_id: str
    max_new_tokens: int  # this chunk's budget, 1 <= budget <= max_tokens - num_generated
    is_migration: bool = False  # resumes on another worker than its previous chunk's


class StepQuota:
    """How many chunks each step may still start in one ``schedule()`` call: the caller's
    fair share of the fleet between steps. A step it does not name may start none."""

    def __init__(self, slots: Mapping[str, int]) -> None:
        self._left = dict(slots)

    def allows(self, step_id: str) -> bool:
        return self._left.get(step_id, 0) > 0

    def take(self, step_id: str) -> None:
        self._left[step_id] -= 1

    def give_back(self, step_id: str) -> None:
        self._left[step_id] += 1

    def as_dict(self) -> dict[str, int]:
        return dict(self._left)


def chunk_budget(request: Request, chunk_size: int | None) -> int:
    """Tokens the next chunk may generate: the chunk size, capped by what is left."""
    if chunk_size is None:
        return request.num_remaining
    return min(chunk_size, request.num_remaining)


class Policy(ABC):
    """Decides what runs where. One instance serves every step of a scheduler."""

    name: ClassVar[str]

    @staticmethod
    def _assign(request: Request, worker: WorkerState, budget: int) -> Assignment:
        """Book a chunk of ``budget`` tokens on ``worker``; the one place chunks and
        migrations are counted."""
        migrated = request.last_worker is not None and request.last_worker != worker.worker_id
        request.num_chunks += 1
        request.num_migrations += int(migrated)
        request.last_worker = worker.worker_id
        return Assignment(request, worker.worker_id, budget, migrated)

    @staticmethod
    def _record_chunk(request: Request, num_new_tokens: int) -> None:
        if num_new_tokens < 0 or request.num_generated + num_new_tokens > request.max_tokens:
            raise ValueError(f"{request.key}: {num_new_tokens} new tokens overflow "
                             f"{request.num_generated}/{request.max_tokens}")
        request.num_generated += num_new_tokens

    @abstractmethod
    def add_step(self, requests: list[Request], lengths: LengthModel, now: float) -> None:
        """A step's requests arrive; the policy sets ``predicted_len`` via ``lengths``."""

    def add_step_in_slices(self, requests: list[Request], lengths: LengthModel, now: float,
                           slice_size: int) -> Iterator[int]:
        """``add_step`` done in slices of about ``slice_size`` requests: yields, after each
        slice, how many of ``requests`` (a prefix) the policy holds so far. Between slices
        the caller may schedule (the held requests may run), and may stop iterating after
        ``cancel_step`` of the step: the rest was never queued. Whole-step decisions are
        the policy's to keep whole. This default hands the step over in one slice."""
        self.add_step(requests, lengths, now)
        yield len(requests)

    @abstractmethod
    def schedule(self, workers: list[WorkerState], now: float,
                 quota: StepQuota | None = None) -> list[Assignment]:
        """Fill free capacity. Called after every event; never over-fills a worker, and
        never starts more chunks of a step than ``quota`` allows (None: no cap)."""

    @abstractmethod
    def on_chunk_done(self, request: Request, worker_id: str, num_new_tokens: int,
                      finished: bool, now: float) -> None:
        """A chunk ended: unfinished requests return to the pool; finished ones are
        reported to the length model (they predict their siblings)."""

    @abstractmethod
    def on_worker_lost(self, worker_id: str, requests: list[Request], now: float) -> None:
        """``requests`` were running on a worker that is gone: queue them again."""

    @abstractmethod
    def cancel_step(self, step_id: str) -> list[Request]:
        """Remove and return the step's queued requests."""

    @abstractmethod
    def num_queued(self) -> int:
        """Requests waiting for a worker."""
