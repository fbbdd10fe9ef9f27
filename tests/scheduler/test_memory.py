"""What the scheduler keeps per sample, counted structurally (tracemalloc over a step of
N samples in this process, never wall time): a sample in flight costs under a bound, a
finished sample's progress is released as it finishes, a batch of results waiting for its
delivery holds no parsed results, and the process imports neither numpy nor redis.

The bounds are the bytes Python allocates per sample (CPython 3.11); the objects they
pay for are named in ``test_a_sample_in_flight_costs_under_a_bound``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import sys
import tracemalloc
import weakref

import grpc
from rhymerl.v1 import common_pb2, worker_pb2

from services.common import packed
from services.scheduler.policies.base import Request
from services.scheduler.step import SampleProgress
from services.scheduler.worker_link import ChunkDone, LinkStream
from tests.aio import run_async
from tests.scheduler.fake_workers import make_core, step

N = 16  # samples per prompt
NUM_PROMPTS = 256  # 4,096 samples: enough that per-sample costs dwarf the fixed ones
SAMPLES = N * NUM_PROMPTS
TOKENS = 4  # every sample: one chunk of 4 tokens
PROMPTS = {f"p{i:05d}": [2 + (i + j) % 80 for j in range(8)] for i in range(NUM_PROMPTS)}

# Per sample in flight, all its chunk's bookkeeping included: Request (~170 B with its
# RequestKey's ~80 B beside it), SampleProgress (~180 B), its seed (36 B), predicted
# length (24 B), arrival number (32 B), its entry in the scheduler's index of
# unfinished samples, the chunk's dispatch id (~62 B) and its entries in the worker's
# running table and its stream's pending one: 671 B measured. A
# (step, progress) tuple per sample (64 B), a str per sample for the step id (72 B),
# each pushes it over.
MAX_BYTES_IN_FLIGHT = 720
# Per sample once its step is done, beyond the kept event (``StepRun.num_bytes`` counts
# it): the step's own small tables (its prompt ids): a sample's progress (~350 B) kept,
# or a copy of its result, goes far over.
MAX_BYTES_DONE_OVER_LOG = 24
# Per sample while every stream's batch of results waits for its delivery: the samples'
# progress (released once delivered) and their events, 791 B measured; not the parsed
# results (~160 B more each: a ChunkDone with its dispatch id) nor a copy for a step log
# that is off.
MAX_BYTES_WAITING = 840


class HoldingStream:
    """A worker's stream that keeps no chunk but its dispatch id, and, once told to
    (``answer``), answers what it was sent, as one batch, whenever it was sent."""

    def __init__(self, link: HoldingLink):
        self.link = link
        self.pending: list[str] = []  # dispatch ids of the chunks not answered
        self.answer = asyncio.Event()
        self._sent = asyncio.Event()
        self.idle = False  # answered all it was sent, and the core asked for more (it is done with them)

    def send(self, policy_version, chunks):
        self.pending += [c.dispatch_id for c in chunks]
        self.link.num_sent += len(chunks)
        self._sent.set()

    def abort(self, dispatch_ids):
        pass

    def close(self):
        pass

    async def events(self):
        tokens, logprobs = packed.pack_token_ids([5] * TOKENS), packed.pack_logprobs([-0.5] * TOKENS)
        while True:
            await self.answer.wait()
            if not self.pending:
                self.idle = True
                await self._sent.wait()
                self.idle = False
            self._sent.clear()
            batch, self.pending = self.pending, []
            yield [ChunkDone(dispatch_id, tokens, TOKENS, logprobs, common_pb2.FINISH_REASON_STOP, 0)
                   for dispatch_id in batch]
            del batch  # the worker keeps nothing of what it answered


class HoldingLink:
    def __init__(self) -> None:
        self.streams: list[HoldingStream] = []
        self.num_sent = 0

    def open(self, worker):
        stream = HoldingStream(self)
        self.streams.append(stream)
        return stream

    def reset(self, worker_id):
        pass

    async def forget(self, worker_id):
        pass


async def until(condition) -> None:
    """Waits for a state of the core (its tasks run meanwhile), never for a time."""
    while not condition():
        await asyncio.sleep(0)


@contextlib.contextmanager
def tracing():
    """tracemalloc on for the block (the counts below are of what it allocates)."""
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def alive(cls, step_id: str) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is cls
               and (o.step_id if cls is Request else o.request.step_id) == step_id)


async def _in_flight(workers: int = 16):
    """A core whose workers hold every chunk of a step of SAMPLES samples: (core, link,
    run, traced bytes before the step)."""
    link = HoldingLink()
    core = make_core(link, workers=workers, capacity=SAMPLES // workers, chunk_size=TOKENS)
    request = step("memory-step-0001", PROMPTS, N, max_tokens=TOKENS)
    await asyncio.sleep(0)
    before = traced()
    run = await core.submit(request)
    await until(lambda: link.num_sent == SAMPLES)
    return core, link, run, before


@run_async
async def test_a_sample_in_flight_costs_under_a_bound():
    with tracing():
        core, _, run, before = await _in_flight()
        per_sample = (traced() - before) / SAMPLES
        assert run.num_running == SAMPLES
        assert per_sample <= MAX_BYTES_IN_FLIGHT, f"{per_sample:.0f} bytes per sample in flight"
        await core.stop()


@run_async
async def test_a_finished_samples_progress_is_released_as_it_finishes():
    """Half the workers answer: their samples' progress is gone while the others still
    run. Then a second step like the first (the tables already sized by it): what it
    leaves once done is its events alone."""
    with tracing():
        core, link, run, _ = await _in_flight()
        first = link.streams[: len(link.streams) // 2]
        for stream in first:
            stream.answer.set()
        await until(lambda: all(s.idle for s in first))
        assert run.num_published == SAMPLES // 2
        assert len(core.unfinished) == SAMPLES // 2 and not run.to_hand_over
        assert alive(SampleProgress, "memory-step-0001") == alive(Request, "memory-step-0001") == SAMPLES // 2
        for stream in link.streams:
            stream.answer.set()
        await until(lambda: run.is_finished and all(s.idle for s in link.streams))
        assert alive(SampleProgress, "memory-step-0001") == alive(Request, "memory-step-0001") == 0
        assert not core.unfinished

        before = traced()
        second = await core.submit(step("memory-step-0002", PROMPTS, N, max_tokens=TOKENS))
        await until(lambda: second.is_finished and all(s.idle for s in link.streams))
        per_sample = (traced() - before - second.num_bytes) / SAMPLES
        assert alive(SampleProgress, "memory-step-0002") == alive(Request, "memory-step-0002") == 0
        assert per_sample <= MAX_BYTES_DONE_OVER_LOG, f"{per_sample:.0f} bytes per finished sample beyond its event"
        await core.stop()


@run_async
async def test_batches_waiting_for_their_delivery_hold_no_parsed_results():
    """Every worker answers at once and every batch's delivery waits (a slow step log):
    what they hold meanwhile is the samples and their events, not the results."""
    with tracing():
        core, link, run, before = await _in_flight()
        waiting, go = [], asyncio.Event()

        async def slow_append(step_id, samples):
            waiting.append(step_id)
            await go.wait()
            return True
        core.log.append = slow_append
        for stream in link.streams:
            stream.answer.set()
        await until(lambda: len(waiting) == len(link.streams))
        per_sample = (traced() - before) / SAMPLES
        assert per_sample <= MAX_BYTES_WAITING, f"{per_sample:.0f} bytes per sample while deliveries wait"
        go.set()
        await run.finished.wait()
        assert run.num_published == SAMPLES
        await core.stop()


class _Response:
    """A LinkResponse stand-in that a weak reference can watch."""

    def __init__(self, results):
        self.results = results


class _Call:
    def __init__(self, responses):
        self.responses = list(responses)

    async def read(self):
        return self.responses.pop(0) if self.responses else grpc.aio.EOF

    def cancel(self):
        pass


@run_async
async def test_a_link_stream_drops_each_parsed_response_before_yielding_its_events():
    """The reader may keep a batch's events waiting for their delivery: the response they
    were parsed from is garbage by then."""
    result = worker_pb2.ChunkResult(request_id="a-1", packed_token_ids=packed.pack_token_ids([3, 4]), num_tokens=2,
                                    packed_logprobs=packed.pack_logprobs([-1.0, -2.0]),
                                    finish_reason=common_pb2.FINISH_REASON_STOP)
    response = _Response([result])
    watch = weakref.ref(response)
    call = _Call([response])
    stream = LinkStream(lambda requests: call)
    del response
    events = stream.events()
    [done] = await events.__anext__()
    assert done.dispatch_id == "a-1" and done.num_tokens == 2
    gc.collect()
    assert watch() is None
    await events.aclose()


def test_the_scheduler_process_imports_neither_numpy_nor_redis():
    """~12 MB each that a scheduler without a step log (and without logprob reports)
    never uses: they load on first use only."""
    code = ("import sys, services.cli, services.scheduler.server; "
            "print(sorted(m for m in ('numpy', 'redis', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
