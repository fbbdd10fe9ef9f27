"""The step router: one trainer-facing step split over scheduler shards by prompt group.

Each shard is a whole scheduler (``rhymerl scheduler``) with its own workers; the router
talks to it only through the trainer-facing RolloutService, as a trainer would. A step's
prompt groups (a prompt and its n samples) wait in the router's queue; each shard is
given at most ``window x capacity`` samples at once (capacity: the slots of its usable
workers, from the registry), as sub-steps of its own (``<step_id>#<router>.<k>``), and
a shard that returns groups takes more from the queue: the shard that finishes early
takes the step's tail (tail stealing at group granularity). The shards' samples are
merged into the trainer's stream under the trainer's step id.

Nothing lost, nothing duplicated: a sample's seed is a function of (step seed, prompt,
index) only (``services/common/ids.py``), and every sub-step carries the step's seed
(one derived from the step id when the trainer set none), so a group re-run on another
shard draws the same samples. When a shard's call breaks (the shard was killed, its
connection lost) or its registry key expires (it hangs), the groups it had not
returned completely go back to the front of the queue; a sample delivered twice (a
re-run group, a hung shard that wakes up) is dropped by its (prompt_id, sample_index).

Versions: a step runs only on shards serving the router's version (the highest any
live shard serves, never lower than one it served before), and a weight push waits for
the running steps, then goes to every shard (steps submitted meanwhile wait for it):
every sample of a step has one version, as with one scheduler in ``after_steps`` mode.
A shard behind the router's version (it was down, or had no worker, during the push) is
caught up by the router: the last update re-sent to it, a load as the same path, a push
as its bytes from the router's weight store (``services/scheduler/weight_store.py``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace

import grpc
from prometheus_client import Counter, Gauge
from rhymerl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from services.common import metrics
from services.common.errors import (FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, RhymerlError,
                                    Unavailable)
from services.common.grpc_server import channel
from services.common.security import TLSConfig, token_metadata
from services.common.validation import MAX_ID_BYTES, check_id, check_length, check_sampling, check_token_ids
from services.common.ids import prompt_id_from_tokens, sample_seed
from services.router.registry import ShardInfo
from services.scheduler.intake import check_step
from services.scheduler.mismatch import checked_report
from services.scheduler.step import fingerprint
from services.scheduler.weight_store import WeightStore

log = logging.getLogger(__name__)
ABORT = common_pb2.FINISH_REASON_ABORT
Key = tuple[str, int]  # (prompt_id, sample_index)

groups_dispatched = Counter("rhymerl:router_groups_dispatched_total", "Prompt groups sent to a shard.", ["shard"])
groups_requeued = Counter("rhymerl:router_groups_requeued_total",
                          "Prompt groups taken back from a shard that failed or left, to run elsewhere.")
duplicates_dropped = Counter("rhymerl:router_duplicates_dropped_total",
                             "Samples a shard returned that the trainer already had (a re-run group).")
shards_caught_up = Counter("rhymerl:router_shards_caught_up_total",
                           "Weight updates re-sent to a shard that was behind the router's version.")
# A shard's registry key shows a version it took within a second (its announce period):
# until then the key's older version is no reason to send the update again.
CATCH_UP_GRACE_S = 3.0
shards_live = Gauge("rhymerl:router_shards", "Shards the router serves with.")
shard_usable = Gauge("rhymerl:router_shard_usable", "1 while the router gives the shard work (alive, answering, "
                     "with usable workers, at the router's version), else 0.", ["shard"])

# A shard call that ends with one of these failed the shard, not the request: its groups run elsewhere.
SHARD_FAULTS = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
                grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNAUTHENTICATED}


class ShardError(RhymerlError):
    """A shard's own answer, passed to the trainer with the shard's status code."""

    def __init__(self, error: grpc.aio.AioRpcError, shard: str):
        super().__init__(f"{error.details()} (shard {shard})")
        self.code = error.code()


def step_seed_of(req: rollout_pb2.SubmitStepRequest) -> int:
    """The seed every sub-step carries: the trainer's, or one derived from the step id
    (so a step without a seed still draws fresh noise per step id, and a re-run group
    draws what its first run drew)."""
    if req.sampling.HasField("seed"):
        return req.sampling.seed
    h = hashlib.blake2b(f"router-step={req.step_id}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


@dataclass
class Shard:
    info: ShardInfo
    stub: rollout_pb2_grpc.RolloutServiceStub
    channel: grpc.aio.Channel
    window: float
    outstanding: int = 0  # samples sent and not returned
    failed: str = ""  # why its last call broke; no work until it answers again
    groups_done: int = 0
    updated_at: float = -math.inf  # when it last took a weight update (its key shows it within a second)

    @property
    def limit(self) -> int:
        return math.ceil(self.info.capacity * self.window)

    def usable(self, version: int) -> bool:
        return not self.failed and self.info.capacity > 0 and self.info.policy_version == version


@dataclass(frozen=True)
class LatestWeights:
    """The update that made the router's version: loaded from ``path``, or pushed bytes
    kept in the router's weight store under ``sha256``."""

    version: int
    path: str = ""
    sha256: str = ""


@dataclass
class SubStep:
    sub_id: str
    shard: Shard
    step: "RoutedStep"
    prompt_ids: list[str]
    remaining: set[Key]
    task: asyncio.Task | None = None


@dataclass
class RoutedStep:
    request: rollout_pb2.SubmitStepRequest  # prompt ids filled in
    fingerprint: str
    version: int
    seed: int
    queue: collections.deque = field(default_factory=collections.deque)  # prompt ids not sent
    running: dict[str, SubStep] = field(default_factory=dict)  # prompt id -> the sub-step running it
    delivered: dict[Key, rollout_pb2.SampleResult] = field(default_factory=dict)
    owner: dict[Key, SubStep] = field(default_factory=dict)
    events: list[rollout_pb2.StepEvent] = field(default_factory=list)
    summaries: list[rollout_pb2.StepSummary] = field(default_factory=list)
    delivery_times: list[float] = field(default_factory=list)
    mismatch: dict[str, rollout_pb2.MismatchStats] = field(default_factory=dict)  # per sub-step
    started: float = 0.0
    waiting_since: float | None = None
    finished: bool = False
    cancelled: bool = False
    error: RhymerlError | None = None
    num_followers: int = 0  # trainers' SubmitStep streams on it now
    unfollowed_since: float | None = field(default_factory=time.monotonic)  # since when none (None: one is)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def step_id(self) -> str:
        return self.request.step_id

    @property
    def n(self) -> int:
        return self.request.n

    @property
    def num_samples(self) -> int:
        return len(self.request.prompts) * self.n

    @functools.cached_property
    def prompt_ids(self) -> frozenset[str]:
        return frozenset(p.prompt_id for p in self.request.prompts)

    def has_sample(self, prompt_id: str, sample_index: int) -> bool:
        """Whether the step has this sample (finished or not)."""
        return 0 <= sample_index < self.n and prompt_id in self.prompt_ids

    def group_done(self, pid: str) -> bool:
        return all((pid, k) in self.delivered for k in range(self.n))

    def notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def follow(self):
        """Every event of the step, from the first: replayed, then as they arrive."""
        i = 0
        self.num_followers += 1
        self.unfollowed_since = None
        try:
            while True:
                changed = self._changed
                while i < len(self.events):
                    yield self.events[i]
                    i += 1
                if self.finished:
                    if self.error is not None:
                        raise self.error
                    return
                await changed.wait()
        finally:
            self.num_followers -= 1
            if not self.num_followers:
                self.unfollowed_since = time.monotonic()


def merge_mismatch(parts: list[rollout_pb2.MismatchStats]) -> rollout_pb2.MismatchStats:
    """Mismatch figures over disjoint sets of samples, as if measured over their union."""
    tokens = sum(p.num_tokens for p in parts)
    if not tokens:
        return rollout_pb2.MismatchStats(num_samples=sum(p.num_samples for p in parts))
    return rollout_pb2.MismatchStats(
        num_samples=sum(p.num_samples for p in parts), num_tokens=tokens,
        num_identical_tokens=sum(p.num_identical_tokens for p in parts),
        mean_abs_diff=sum(p.mean_abs_diff * p.num_tokens for p in parts) / tokens,
        max_abs_diff=max(p.max_abs_diff for p in parts),
        mean_log_ratio=sum(p.mean_log_ratio * p.num_tokens for p in parts) / tokens,
        kl=sum(p.kl * p.num_tokens for p in parts) / tokens)


class Router:
    """Steps, shards and the queue between them (one per router process).

    Args:
        window: samples given to a shard at once, as a multiple of its capacity.
        no_shard_timeout_s: queued groups no shard could take this long end as ABORT.
        max_steps_retained: finished steps kept (re-submission, rewards, logprobs).
        max_samples_retained: and at most this many samples over the steps kept (the
            oldest finished steps go first; a step in flight is always kept).
        max_samples_in_flight: most samples of the unfinished steps together (each kept
            with its tokens as it passes): a step beyond is RESOURCE_EXHAUSTED, as one
            scheduler refuses it, instead of growing the router's memory without bound.
        tls: for the channels to the shards; shard_token: bearer token sent to them.
        store: where pushed weights are kept for catching shards up (default: a private
            temporary directory).
        journal: records the steps in flight (``ShardDirectory``'s ``step_started`` and
            ``step_finished``), so a restarted router knows which steps trainers will
            re-submit (``resume``); None: not recorded.
        abandoned_step_timeout_s: a step no trainer follows this long is cancelled
            (``cancel_abandoned``; 0: never). The router's own streams to the shards keep
            its sub-steps followed there, so this is the one that applies to a routed step.
    """

    def __init__(self, window: float = 1.0, no_shard_timeout_s: float = 120.0, max_steps_retained: int = 64,
                 tls: TLSConfig | None = None, shard_token: str = "", max_samples_retained: int = 262_144,
                 store: WeightStore | None = None, journal=None, abandoned_step_timeout_s: float = 300.0,
                 max_samples_in_flight: int = 4_194_304):
        self.window, self.no_shard_timeout_s, self.max_steps_retained = window, no_shard_timeout_s, max_steps_retained
        self.abandoned_step_timeout_s = abandoned_step_timeout_s
        self.max_samples_retained = max_samples_retained
        self.max_samples_in_flight = max_samples_in_flight
        self.tls = tls
        self.metadata = token_metadata(shard_token)
        self.shards: dict[str, Shard] = {}
        self.store = store if store is not None else WeightStore()
        self.latest: LatestWeights | None = None
        self._version = 0  # the highest version served so far: a step never runs older weights
        self._catching_up: set[str] = set()
        self.journal = journal
        self.pending: dict[str, int] = {}  # steps a previous router ran, not re-submitted yet
        self._pending_until = 0.0
        self._pending_done = asyncio.Event()
        self._pending_done.set()
        self.steps: collections.OrderedDict[str, RoutedStep] = collections.OrderedDict()
        self.active: list[RoutedStep] = []  # unfinished, in submission order
        self.nonce = os.urandom(4).hex()  # sub-step ids of this router process never repeat a previous one's
        self._counter = 0
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._push_done = asyncio.Event()
        self._push_done.set()
        self._push_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._assigner: asyncio.Task | None = None

    # --- shards ----------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The highest version a shard serves, never lower than one served before (a
        shard that left with the newest weights does not send steps back to older ones)."""
        live = [s.info.policy_version for s in self.shards.values() if not s.failed and s.info.capacity > 0]
        now = max(live, default=max((s.info.policy_version for s in self.shards.values()), default=0))
        self._version = max(self._version, now)
        return self._version

    def updated(self, latest: LatestWeights) -> None:
        """A weight update some shard took: what a shard behind it is caught up with."""
        if self.latest is None or latest.version >= self.latest.version:
            self.latest = latest
            if latest.sha256:
                self.store.keep_only(latest.sha256)

    def catch_up(self) -> None:
        """Every answering shard with workers that is behind the router's version gets the
        update that made it (once at a time per shard; a failed one is tried again)."""
        latest = self.latest
        if latest is None or latest.version != self.version:
            return
        for shard in self.shards.values():
            info = shard.info
            if (shard.failed or info.capacity == 0 or info.policy_version >= latest.version
                    or info.shard_id in self._catching_up or time.monotonic() - shard.updated_at < CATCH_UP_GRACE_S):
                continue
            self._catching_up.add(info.shard_id)
            self._spawn(self._catch_up(shard, latest))

    async def _catch_up(self, shard: Shard, latest: LatestWeights) -> None:
        shard_id = shard.info.shard_id
        log.info("shard %s serves version %d, the router %d: sending it the %s", shard_id,
                 shard.info.policy_version, latest.version, "load" if latest.path else "pushed bytes")
        try:
            if latest.path:
                result = await shard.stub.LoadWeights(common_pb2.LoadWeightsRequest(
                    version=latest.version, path=latest.path), timeout=600, metadata=self.metadata)
            else:
                result = await shard.stub.PushWeights(self.store.stream(latest.version, latest.sha256), timeout=600,
                                                      metadata=self.metadata)
        except (grpc.aio.AioRpcError, FileNotFoundError) as exc:
            log.warning("shard %s not caught up to version %d: %s", shard_id, latest.version,
                        exc.details() if isinstance(exc, grpc.aio.AioRpcError) else exc)
            return
        finally:
            self._catching_up.discard(shard_id)
        if self.shards.get(shard_id) is shard:
            shard.info = replace(shard.info, policy_version=max(shard.info.policy_version, result.version))
            shard.updated_at = time.monotonic()
        shards_caught_up.inc()
        log.info("shard %s caught up to version %d", shard_id, result.version)
        self.wake()

    def update_shards(self, found: dict[str, ShardInfo]) -> None:
        """The registry's shards now: new ones join, gone ones leave (their groups re-queued)."""
        for shard_id, info in found.items():
            shard = self.shards.get(shard_id)
            if shard is not None and shard.info.address != info.address:
                self._remove(shard, "moved")
                shard = None
            if shard is None:
                ch = channel(info.address, self.tls)
                self.shards[shard_id] = Shard(info, rollout_pb2_grpc.RolloutServiceStub(ch), ch, self.window)
                log.info("shard %s at %s joined (capacity %d, version %d)", shard_id, info.address, info.capacity,
                         info.policy_version)
            else:
                if (info.policy_version < shard.info.policy_version
                        and time.monotonic() - shard.updated_at < CATCH_UP_GRACE_S):
                    # it took a weight update its key does not show yet (rewritten within a
                    # second): the version it answered with stands
                    info = replace(info, policy_version=shard.info.policy_version)
                shard.info = info
        for shard_id in [s for s in self.shards if s not in found]:
            self._remove(self.shards[shard_id], "its registry key expired")
        shards_live.set(len(self.shards))
        self.wake()

    def _remove(self, shard: Shard, why: str) -> None:
        log.warning("shard %s at %s left (%s)", shard.info.shard_id, shard.info.address, why)
        del self.shards[shard.info.shard_id]
        with contextlib.suppress(KeyError):
            shard_usable.remove(shard.info.shard_id)
        for step in self.active:
            for sub in {id(s): s for s in step.running.values()}.values():
                if sub.shard is shard and sub.task is not None:
                    sub.task.cancel()  # its finally re-queues the groups
        self._spawn(shard.channel.close())

    async def probe_failed(self) -> None:
        """A shard whose call broke gets work again once it answers."""
        async def probe(shard: Shard) -> None:
            try:
                stats = await shard.stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=2.0, metadata=self.metadata)
            except grpc.aio.AioRpcError:
                return
            shard.info = replace(shard.info, policy_version=stats.policy_version)
            log.info("shard %s answers again", shard.info.shard_id)
            shard.failed = ""
            self.wake()

        await asyncio.gather(*(probe(s) for s in list(self.shards.values()) if s.failed))

    def publish_usable(self) -> None:
        """The ``rhymerl:router_shard_usable`` gauge, per shard, as of now."""
        version = self.version
        for shard in self.shards.values():
            shard_usable.labels(shard=shard.info.shard_id).set(int(shard.usable(version)))

    def _shard_failed(self, shard: Shard, why: str) -> None:
        if not shard.failed:
            log.warning("shard %s failed: %s; its groups run elsewhere", shard.info.shard_id, why)
        shard.failed = why or "failed"

    # --- steps -----------------------------------------------------------------------
    def check(self, req: rollout_pb2.SubmitStepRequest) -> rollout_pb2.SubmitStepRequest:
        """The trainer's request checked as one scheduler checks it (each error names its
        field, in the trainer's numbering); returns it with every prompt id filled in."""
        check_step(req, self.version)
        usable = [s.info for s in self.shards.values() if not s.failed and s.info.capacity > 0]
        if not usable:
            raise Unavailable("no scheduler shard is alive with a usable worker")
        vocab = min((i.vocab_size for i in usable if i.vocab_size), default=0)
        max_len = min((i.max_model_len for i in usable if i.max_model_len), default=0)
        check_sampling(req.sampling, "sampling", vocab)
        out = rollout_pb2.SubmitStepRequest()
        out.CopyFrom(req)
        seen = set()
        for i, prompt in enumerate(out.prompts):
            name = f"prompts[{i}]"
            check_token_ids(prompt.token_ids, f"{name}.token_ids", vocab)
            check_length(len(prompt.token_ids), req.sampling.max_tokens, max_len, f"{name}.token_ids",
                         "sampling.max_tokens")
            if prompt.prompt_id:
                check_id(prompt.prompt_id, f"{name}.prompt_id")
            else:
                prompt.prompt_id = prompt_id_from_tokens(prompt.token_ids)
            if prompt.prompt_id in seen:
                raise InvalidArgument(f"duplicate prompt_id {prompt.prompt_id!r}", f"{name}.prompt_id")
            seen.add(prompt.prompt_id)
        return out

    async def submit(self, req: rollout_pb2.SubmitStepRequest) -> RoutedStep:
        """Starts a step, or joins the one with this step id (same content), or re-runs
        the aborted samples of a finished one."""
        await self._push_done.wait()  # a weight push in progress: the step starts after it
        check_id(req.step_id, "step_id")
        known = self.steps.get(req.step_id)
        if known is not None and known.fingerprint != fingerprint(req):
            raise FailedPrecondition(f"step {req.step_id!r} was already submitted with different content", "step_id")
        if known is not None and not (known.finished and any(s.finish_reason == ABORT
                                                              for s in known.delivered.values())):
            return known
        checked = self.check(req)
        in_flight = sum(s.num_samples for s in self.active)
        if in_flight + len(checked.prompts) * checked.n > self.max_samples_in_flight:  # before anything is kept
            raise ResourceExhausted(f"{len(checked.prompts) * checked.n} samples would exceed the limit of samples "
                                    f"in flight ({in_flight} of {self.max_samples_in_flight} used)", "prompts")
        if known is not None:  # re-run the aborted samples; the others are replayed
            self.steps.pop(req.step_id)
        step = RoutedStep(checked, fingerprint(req), self.version, step_seed_of(req), started=time.monotonic())
        if known is not None:
            by_owner: dict[int, tuple[SubStep | None, list]] = {}
            for key, sample in known.delivered.items():
                if sample.finish_reason != ABORT:
                    owner = known.owner[key]
                    by_owner.setdefault(id(owner), (owner, []))[1].append(sample)
            for owner, kept in by_owner.values():
                self._record(step, kept, owner)
        step.queue.extend(p.prompt_id for p in checked.prompts if not step.group_done(p.prompt_id))
        self.steps[req.step_id] = step
        self._forget_old_steps()
        if step.queue:
            self.active.append(step)
            self._idle.clear()
            self.wake()
            self._journal("step_started", step.step_id, step.version)
        else:
            self._finish(step)
        self._resubmitted(req.step_id)
        return step

    def _forget_old_steps(self) -> None:
        """The oldest finished steps go while more steps or samples are kept than allowed."""
        kept = sum(s.num_samples for s in self.steps.values())
        for step_id, step in list(self.steps.items()):
            if len(self.steps) <= self.max_steps_retained and kept <= self.max_samples_retained:
                return
            if step.finished:
                del self.steps[step_id]
                kept -= step.num_samples

    def get(self, step_id: str) -> RoutedStep:
        check_id(step_id, "step_id")
        step = self.steps.get(step_id)
        if step is None:
            raise NotFound(f"no step {step_id!r}", "step_id")
        return step

    def _sub_id(self, step_id: str) -> str:
        self._counter += 1
        suffix = f"#{self.nonce}.{self._counter}"
        if len(step_id.encode()) + len(suffix) > MAX_ID_BYTES:
            step_id = "h" + hashlib.blake2b(step_id.encode(), digest_size=16).hexdigest()
        return step_id + suffix

    # --- dispatch --------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._assigner = asyncio.create_task(self._assign_loop())

    async def _assign_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self.assign()
            except Exception:  # noqa: BLE001 - the loop must outlive a bug in one round
                log.exception("assigning groups failed")

    def assign(self) -> None:
        """Sends queued groups to shards with room, steps in submission order: while the
        queue exceeds the room, each shard fills its window; once the room exceeds it,
        the rest is split in proportion to each shard's room (its capacity, at a step's
        start)."""
        for step in list(self.active):
            if not step.queue:
                continue
            shards = [s for s in self.shards.values() if s.usable(step.version)]
            if not shards:
                step.waiting_since = step.waiting_since or time.monotonic()
                continue
            step.waiting_since = None
            room = {s.info.shard_id: max(0, s.limit - s.outstanding) for s in shards}
            total = sum(room.values())
            if total == 0 and all(s.outstanding for s in shards):
                return  # every shard is full: later steps wait too
            num_queued = len(step.queue)
            for shard in sorted(shards, key=lambda s: -room[s.info.shard_id]):
                free = room[shard.info.shard_id]
                if num_queued * step.n <= total:  # the rest fits: split in proportion to the room
                    take = math.ceil(num_queued * free / total)
                else:  # refill a window once a quarter of it is free: fewer, larger sub-steps
                    take = free // step.n if free >= shard.limit / 4 else 0
                if take < 1 and shard.outstanding == 0:
                    take = 1  # a group larger than a shard's window still runs, alone
                take = min(take, len(step.queue))
                if take > 0:
                    self._dispatch(step, shard, [step.queue.popleft() for _ in range(take)])

    def _dispatch(self, step: RoutedStep, shard: Shard, prompt_ids: list[str]) -> None:
        sub = SubStep(self._sub_id(step.step_id), shard, step, prompt_ids,
                      {(p, k) for p in prompt_ids for k in range(step.n)})
        for pid in prompt_ids:
            step.running[pid] = sub
        shard.outstanding += len(sub.remaining)
        groups_dispatched.labels(shard=shard.info.shard_id).inc(len(prompt_ids))
        sub.task = self._spawn(self._run(sub))

    def _sub_request(self, sub: SubStep) -> rollout_pb2.SubmitStepRequest:
        step = sub.step
        by_id = {p.prompt_id: p for p in step.request.prompts}
        req = rollout_pb2.SubmitStepRequest(step_id=sub.sub_id, policy_version=step.request.policy_version,
                                            prompts=[by_id[p] for p in sub.prompt_ids], n=step.n)
        req.sampling.CopyFrom(step.request.sampling)
        req.sampling.seed = step.seed
        return req

    async def _run(self, sub: SubStep) -> None:
        """One sub-step on its shard; whatever it did not return goes back to the queue."""
        shard, step = sub.shard, sub.step
        try:
            call = shard.stub.SubmitStep(self._sub_request(sub), metadata=self.metadata)
            async for event in call:
                if event.HasField("summary"):
                    step.summaries.append(event.summary)
                else:
                    self._receive(sub, event)
            shard.groups_done += len(sub.prompt_ids)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in SHARD_FAULTS:
                self._shard_failed(shard, f"{exc.code().name}: {exc.details()}")
            elif not step.finished:  # the request itself (every shard would refuse it): the step fails
                step.error = ShardError(exc, shard.info.shard_id)
                self._finish(step)
        finally:
            shard.outstanding -= len(sub.remaining)
            self._requeue(sub)
            self.wake()

    def _requeue(self, sub: SubStep) -> None:
        step = sub.step
        back = [p for p in sub.prompt_ids if step.running.get(p) is sub and not step.group_done(p)]
        for pid in sub.prompt_ids:
            if step.running.get(pid) is sub:
                del step.running[pid]
        if back and not step.finished:
            step.queue.extendleft(reversed(back))
            groups_requeued.inc(len(back))
            log.info("step %s: %d groups of shard %s run again elsewhere", step.step_id, len(back),
                     sub.shard.info.shard_id)

    def _receive(self, sub: SubStep, event: rollout_pb2.StepEvent) -> None:
        """A shard's event of one sample or a batch (a shard sends the samples it has
        ready together): the ones the trainer does not have yet go on in one event."""
        step = sub.step
        batch = event.samples.samples if event.HasField("samples") else [event.sample]
        fresh = []
        for sample in batch:
            key = (sample.prompt_id, sample.sample_index)
            if key in sub.remaining:
                sub.remaining.discard(key)
                sub.shard.outstanding -= 1
            if key in step.delivered or step.finished:
                duplicates_dropped.inc()
                continue
            step.delivered[key] = sample  # claimed: a repeat later in the batch is dropped too
            fresh.append(sample)
        if fresh:
            self._record(step, fresh, sub, event if len(fresh) == len(batch) else None)
        if len(step.delivered) == step.num_samples:
            self._finish(step)

    def _record(self, step: RoutedStep, samples: list[rollout_pb2.SampleResult], sub: SubStep | None,
                event: rollout_pb2.StepEvent | None = None) -> None:
        """Keeps samples (the shard's own messages, renamed to the trainer's step: no copy)
        and passes them to the step's followers in one event: ``event``, the shard's own,
        when it holds exactly these samples; else a new one."""
        now = time.monotonic()
        for sample in samples:
            key = (sample.prompt_id, sample.sample_index)
            sample.step_id = step.step_id
            step.delivered[key] = sample
            step.owner[key] = sub
            step.delivery_times.append(now)
        if event is None:
            event = rollout_pb2.StepEvent(sample=samples[0]) if len(samples) == 1 else \
                rollout_pb2.StepEvent(samples=rollout_pb2.SampleBatch(samples=samples))
        step.events.append(event)
        step.notify()

    def _finish(self, step: RoutedStep) -> None:
        if step.finished:
            return
        step.finished = True
        if step in self.active:
            self.active.remove(step)
        for sub in {id(s): s for s in step.running.values()}.values():
            if sub.task is not None:
                sub.task.cancel()
        if step.error is None:
            step.events.append(rollout_pb2.StepEvent(summary=self._summary(step)))
        self._journal("step_finished", step.step_id)
        if not self.active:
            self._idle.set()
        step.notify()

    def _summary(self, step: RoutedStep) -> rollout_pb2.StepSummary:
        """The merged summary: counts over the delivered samples; the workers' busy time
        and the history hit rate over the shards' sub-steps."""
        samples = list(step.delivered.values())
        times = sorted(step.delivery_times)
        makespan = (times[-1] - step.started) if times else 0.0
        tail = times[-1] - times[max(0, math.ceil(0.9 * len(times)) - 1)] if times else 0.0
        out = rollout_pb2.StepSummary(
            step_id=step.step_id, num_samples=len(samples),
            num_generated_tokens=sum(len(s.token_ids) for s in samples), makespan_s=makespan, tail_time_s=tail,
            num_migrations=sum(s.num_migrations for s in samples))
        out.spec.num_verify_steps = sum(s.spec.num_verify_steps for s in samples)
        out.spec.num_draft_tokens = sum(s.spec.num_draft_tokens for s in samples)
        out.spec.num_accepted_tokens = sum(s.spec.num_accepted_tokens for s in samples)
        weight = sum(s.num_samples for s in step.summaries)
        if weight:
            out.bubble_ratio = sum(s.bubble_ratio * s.num_samples for s in step.summaries) / weight
            out.history_hit_rate = sum(s.history_hit_rate * s.num_samples for s in step.summaries) / weight
        for s in step.summaries:
            for worker, busy in s.worker_busy_s.items():
                out.worker_busy_s[worker] = out.worker_busy_s.get(worker, 0.0) + busy
        policies = sorted({s.policy for s in step.summaries if s.policy})
        out.policy = "router:" + ",".join(policies)
        return out

    def expire_waiting(self) -> None:
        """Groups no shard could take for no_shard_timeout_s end as ABORT with the reason."""
        now = time.monotonic()
        for step in list(self.active):
            if step.waiting_since is None or now - step.waiting_since < self.no_shard_timeout_s:
                continue
            error = (f"no scheduler shard served version {step.version} for "
                     f"{now - step.waiting_since:.0f} s")
            self._abort_queued(step, error)

    def cancel_abandoned(self, now: float | None = None) -> list[str]:
        """Cancels the steps no trainer has followed for ``abandoned_step_timeout_s`` (as
        CancelStep does; the scheduler's ``cancel_abandoned`` is the same for a step sent to
        it directly). Returns their ids."""
        if not self.abandoned_step_timeout_s:
            return []
        now = time.monotonic() if now is None else now
        gone = [step for step in self.active if not step.finished and not step.cancelled
                and step.unfollowed_since is not None and now - step.unfollowed_since >= self.abandoned_step_timeout_s]
        for step in gone:
            log.warning("step %s: no trainer followed it for %.0f s (abandoned_step_timeout_s): cancelling it",
                        step.step_id, now - step.unfollowed_since)
            metrics.steps_abandoned_total.inc()
            self._spawn(self.cancel(step.step_id))
        return [step.step_id for step in gone]

    def _abort_queued(self, step: RoutedStep, error: str) -> int:
        aborted = []
        while step.queue:
            pid = step.queue.popleft()
            aborted += [rollout_pb2.SampleResult(prompt_id=pid, sample_index=k, finish_reason=ABORT, error=error,
                                                 seed=sample_seed(step.seed, step.step_id, pid, k))
                        for k in range(step.n) if (pid, k) not in step.delivered]
        if aborted:
            self._record(step, aborted, None)
        if len(step.delivered) == step.num_samples:
            self._finish(step)
        return len(aborted)

    async def cancel(self, step_id: str) -> int:
        step = self.get(step_id)
        if step.finished:
            return 0
        step.cancelled = True
        num = self._abort_queued(step, "")
        subs = {id(s): s for s in step.running.values()}.values()
        answers = await asyncio.gather(*(s.shard.stub.CancelStep(rollout_pb2.CancelStepRequest(step_id=s.sub_id),
                                                                 timeout=30, metadata=self.metadata)
                                         for s in subs), return_exceptions=True)
        return num + sum(a.num_cancelled for a in answers if isinstance(a, rollout_pb2.CancelStepResponse))

    # --- per-sample reports, routed to the shard that produced the sample ---------------
    def check_logprobs_report(self, step: RoutedStep, request: rollout_pb2.ReportLogprobsRequest) -> None:
        """The whole report checked as a scheduler checks it (services/scheduler/mismatch.py),
        before any shard sees it: each error names the trainer's field (a shard's names the
        position in the part sent to it), and no shard records part of a refused report."""
        checked_report(request, step.request.sampling.logprobs, step.delivered, step.has_sample, step.step_id)

    def owners(self, step: RoutedStep, keys: list[tuple[str, int, str]]) -> dict[str, tuple[SubStep, list[int]]]:
        """(prompt_id, sample_index, field) -> per sub-step, the reported items' positions."""
        by_sub: dict[str, tuple[SubStep, list[int]]] = {}
        for i, (pid, k, name) in enumerate(keys):
            sub = step.owner.get((pid, k))
            if sub is None:
                raise NotFound(f"no sample ({pid!r}, {k}) in step {step.step_id!r}"
                               + (" delivered by a shard" if (pid, k) in step.delivered else ""), name)
            by_sub.setdefault(sub.sub_id, (sub, []))[1].append(i)
        return by_sub

    async def call_shard(self, shard: Shard, method: str, request, timeout: float = 60.0):
        try:
            return await getattr(shard.stub, method)(request, timeout=timeout, metadata=self.metadata)
        except grpc.aio.AioRpcError as exc:
            raise ShardError(exc, shard.info.shard_id) from None

    # --- steps of a previous router process -------------------------------------------
    def resume(self, in_flight: dict[str, int], wait_s: float) -> None:
        """Steps the previous router was running: trainers re-submit them, and until they
        do (or ``wait_s`` passes) no weight update starts, so each runs again at the
        version its first samples had (its seeds are its own: the same samples)."""
        self.pending = dict(in_flight)
        self._pending_until = time.monotonic() + wait_s
        if self.pending:
            self._pending_done.clear()
            log.info("%d steps of the previous router: weight updates wait up to %g s for their re-submission",
                     len(self.pending), wait_s)

    def _resubmitted(self, step_id: str) -> None:
        if self.pending.pop(step_id, None) is not None and not self.pending:
            self._pending_done.set()

    def _journal(self, method: str, *args) -> None:
        if self.journal is not None:
            self._spawn(self._journal_call(method, *args))

    async def _journal_call(self, method: str, *args) -> None:
        try:
            await getattr(self.journal, method)(*args)
        except Exception as exc:  # noqa: BLE001 - the record is a courtesy to the next router: never fail a step
            log.warning("step journal: %s%s failed: %s", method, args, exc)

    async def _wait_resubmitted(self) -> None:
        remaining = self._pending_until - time.monotonic()
        if self.pending and remaining > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._pending_done.wait(), remaining)
        if self.pending:
            log.warning("weight update: %d steps of the previous router were not re-submitted in time (%s)",
                        len(self.pending), ", ".join(sorted(self.pending)[:5]))
            for step_id in self.pending:
                self._journal("step_finished", step_id)
            self.pending.clear()
            self._pending_done.set()

    # --- weights -----------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def weights_gate(self):
        """Around a weight push: new steps wait for it; it waits for the running steps
        (and for the previous router's, until re-submitted)."""
        async with self._push_lock:
            await self._wait_resubmitted()  # before new steps are held: re-submissions must get in
            self._push_done.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._push_done.set()
                self.wake()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def stop(self) -> None:
        if self._assigner is not None:
            self._assigner.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for shard in self.shards.values():
            await shard.channel.close()
        self.store.close()
