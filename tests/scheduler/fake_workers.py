"""In-process fake workers for the scheduler core: no gRPC, no model.

A sample's token at position i is a function of its seed and i, and it stops at a length
fixed by its seed, so a re-run chunk (after a lost worker, on another worker) gives the
same tokens, as a real seeded sampler does. Faults are switches on the link.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
from rhymerl.v1 import common_pb2, rollout_pb2

from services.common import packed
from services.scheduler.core import CoreLimits, SchedulerCore
from services.scheduler.policies import make_policy
from services.scheduler.step_log import StepLog
from services.scheduler.step_table import StepTable
from services.scheduler.worker_link import ChunkDone, ChunkFailed, RunEnded, RunOutcome
from services.scheduler.workers import WorkerTable


def token(seed: int, position: int) -> int:
    return (seed * 31 + position * 7) % 89 + 2


def true_length(seed: int, max_tokens: int) -> int:
    return min(max_tokens, seed % 23 + 3)


class FakeStream:
    """One worker's stream: each batch sent is answered as one batch of results (the
    faults of its link applied), as ``worker_link.LinkStream`` yields them."""

    def __init__(self, link: "FakeLink", worker):
        self.link, self.worker = link, worker
        self.batches: asyncio.Queue = asyncio.Queue()
        self.closed = False

    def send(self, policy_version, chunks):
        for c in chunks:
            self.link.chunks_started[c.key] += 1
            self.link.start_order.append(c.key)
        self.link.batch_sizes.append(len(chunks))
        self.batches.put_nowait((policy_version, chunks))

    def abort(self, dispatch_ids):
        self.link.aborted += dispatch_ids

    def close(self):
        self.closed = True

    async def events(self):
        link, worker_id = self.link, self.worker.worker_id
        while True:
            policy_version, chunks = await self.batches.get()
            results = []
            for c in chunks:
                await asyncio.sleep(0)
                if link.gate is not None:
                    await link.gate.wait()
                if worker_id in link.die_after:
                    if link.die_after[worker_id] <= 0:
                        if results:
                            yield results
                        yield RunEnded(RunOutcome.LOST, "UNAVAILABLE: injected crash")
                        return
                    link.die_after[worker_id] -= 1
                if c.key.prompt_id in link.poison:
                    results.append(ChunkFailed(c.dispatch_id, "RuntimeError: injected engine failure"))
                    continue
                start, seed = c.num_generated, c.seed
                end = min(true_length(seed, c.sampling.max_tokens), start + c.max_new_tokens)
                tokens = [token(seed, i) for i in range(start, end)]
                link.generated += len(tokens)
                finish = common_pb2.FINISH_REASON_UNSPECIFIED
                if end == true_length(seed, c.sampling.max_tokens):
                    finish = common_pb2.FINISH_REASON_STOP if end < c.sampling.max_tokens else \
                        common_pb2.FINISH_REASON_LENGTH
                results.append(ChunkDone(c.dispatch_id, packed.pack_token_ids(tokens), len(tokens),
                                         packed.pack_logprobs([-0.5] * len(tokens)), finish,
                                         link.versions.get(worker_id, policy_version)))
            yield results


class FakeLink:
    def __init__(self) -> None:
        self.generated = 0  # tokens produced, all workers
        self.chunks_started: Counter = Counter()  # RequestKey -> chunks sent
        self.start_order: list = []  # the RequestKey of every chunk sent, in order
        self.batch_sizes: list[int] = []  # chunks of every batch sent, in order
        self.poison: set[str] = set()  # prompt ids whose chunks fail the engine
        self.die_after: dict[str, int] = {}  # worker_id -> results before its streams break
        self.gate: asyncio.Event | None = None  # when set (not None), chunks wait for it
        self.versions: dict[str, int] = {}  # worker_id -> the version it reports
        self.aborted: list[str] = []
        self.loads: list[tuple[str, int, str]] = []  # (worker_id, version, path) of LoadWeights calls
        self.streams: list[FakeStream] = []  # every stream opened, in order

    def open(self, worker):
        stream = FakeStream(self, worker)
        self.streams.append(stream)
        return stream

    def reset(self, worker_id):
        pass

    def stub(self, worker):
        """WorkerService's weight calls: a load always succeeds (``loads`` records it)."""
        link = self

        class Stub:
            async def LoadWeights(self, request, timeout=None):  # noqa: N802 - gRPC's name
                if request.version <= worker.policy_version:  # as a worker: a path probe, or an old version
                    raise grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(),
                                               grpc.aio.Metadata(), "version: must be greater")
                link.loads.append((worker.worker_id, request.version, request.path))
                return common_pb2.WeightUpdateResponse(version=request.version, num_workers_updated=1)
        return Stub()

    async def forget(self, worker_id):
        pass


def make_core(link: FakeLink, *, workers: int = 2, capacity: int = 4, policy: str = "rhymerl",
              chunk_size: int = 4, redis_url: str = "", steps: StepTable | None = None, **limits) -> SchedulerCore:
    kwargs = {"chunk_size": chunk_size} if policy in ("seer", "rhymerl") else {}
    core = SchedulerCore(make_policy(policy, **kwargs), WorkerTable(), link, step_log=StepLog(redis_url),
                         steps=steps, limits=CoreLimits(**limits))
    for i in range(workers):
        core.register(f"w{i}", f"fake:{i}", capacity, 0, 96, 512)
    core.start()
    return core


def step(step_id: str, prompts: dict[str, list[int]], n: int, max_tokens: int = 20, seed: int = 1,
         ) -> rollout_pb2.SubmitStepRequest:
    return rollout_pb2.SubmitStepRequest(
        step_id=step_id, n=n, sampling=common_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed,
                                                                  logprobs=True),
        prompts=[common_pb2.Prompt(prompt_id=p, token_ids=t) for p, t in prompts.items()])


async def dispatch_pass(core: SchedulerCore) -> None:
    """Wakes the dispatch loop and returns once it has made a pass (a state, not a delay:
    the loop clears its wake-up and places work in one go, with no await between)."""
    core.wake()
    while core._wake.is_set():
        await asyncio.sleep(0)


async def collect(run) -> tuple[list[rollout_pb2.SampleResult], rollout_pb2.StepSummary]:
    samples, summary = [], None
    async for event in run.follow():
        if event.HasField("summary"):
            summary = event.summary
        else:
            samples.append(event.sample)
    return samples, summary


def expected_tokens(sample: rollout_pb2.SampleResult, max_tokens: int) -> list[int]:
    return [token(sample.seed, i) for i in range(true_length(sample.seed, max_tokens))]
