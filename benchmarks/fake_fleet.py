"""A fleet of fake rollout workers that answer instantly: the control plane's load generator.

Each fake worker is a real WorkerService endpoint (its own gRPC server and port on
loopback) that registers with the scheduler exactly as a real worker does
(``services.rollout.registration.keep_registered``: one Heartbeat stream over its own
channel, a beat at the interval the scheduler names), answers stats polls, and answers
every batch on its Link stream at once: each item gets ``response_tokens`` fixed tokens in total (fewer
when its ``max_tokens`` or chunk budget ends first), then FINISH_REASON_STOP. No model,
no engine: what is measured is the scheduler.

Many workers share a process (``per_process``, 64 by default), each process one asyncio
loop; ``FakeFleet`` starts the processes (spawned, so no gRPC state is forked), collects
their counters and stops them. ``benchmarks/control_plane.py`` and its test use it.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
from collections import Counter
from dataclasses import dataclass

from services.local import StartStop

VOCAB_SIZE = 32_000
MAX_MODEL_LEN = 8_192


@dataclass(frozen=True)
class FleetSpec:
    scheduler_address: str
    workers: int
    slots: int = 256  # max_num_seqs each registers with
    response_tokens: int = 16  # tokens of every finished sample
    logprobs: bool = True  # one logprob per token when the sampling asks for them
    heartbeat_s: float = 5.0  # until the scheduler names its interval (RHYMERL_WORKER_HEARTBEAT_S)
    per_process: int = 64
    prefix: str = "fake"
    channel_options: tuple[tuple[str, int], ...] = ()  # added to every channel (benchmarks compare options)


@functools.lru_cache(maxsize=1 << 16)
def _tokens(position: int, count: int, sample_index: int) -> bytes:
    """The fake tokens, packed as a worker sends them (cached: the fakes share the cores
    with the scheduler they load)."""
    from services.common import packed

    return packed.pack_token_ids([3 + (sample_index * 31 + position + i) % (VOCAB_SIZE - 3) for i in range(count)])


@functools.lru_cache(maxsize=1024)
def _logprobs(count: int) -> bytes:
    from services.common import packed

    return packed.pack_logprobs([-0.5] * count)


def make_servicer(worker_id: str, spec: FleetSpec, counts: Counter):
    """One fake worker's WorkerService (counts into ``counts``: batches, items, tokens,
    finished, stats polls, aborts). Each batch on its Link stream is answered at once, by
    one batch of results."""
    from rhymerl.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    class FakeWorker(worker_pb2_grpc.WorkerServiceServicer):
        running = 0

        async def Link(self, request_iterator, context):
            async for batch in request_iterator:
                counts["batches"] += 1
                counts["items"] += len(batch.items)
                counts["aborts"] += len(batch.abort_request_ids)
                results = [self._answer(item, batch.policy_version) for item in batch.items]
                if results:
                    yield worker_pb2.LinkResponse(results=results)

        def _answer(self, item, policy_version: int):
            done = len(item.generated_token_ids)
            limit = item.sampling.max_tokens or spec.response_tokens
            n = max(0, min(item.max_new_tokens, spec.response_tokens - done, limit - done))
            total = done + n
            finish = (common_pb2.FINISH_REASON_STOP if total >= spec.response_tokens
                      else common_pb2.FINISH_REASON_LENGTH if total >= limit
                      else common_pb2.FINISH_REASON_UNSPECIFIED)
            counts["tokens"] += n
            counts["finished"] += finish != common_pb2.FINISH_REASON_UNSPECIFIED
            return worker_pb2.ChunkResult(
                request_id=item.request_id, packed_token_ids=_tokens(done, n, item.sample_index), num_tokens=n,
                packed_logprobs=_logprobs(n) if spec.logprobs and item.sampling.logprobs else b"",
                finish_reason=finish, policy_version=policy_version)

        async def Abort(self, request, context):
            counts["aborts"] += len(request.request_ids)
            return worker_pb2.AbortResponse(num_aborted=0)

        async def GetWorkerStats(self, request, context):
            counts["stats"] += 1
            return worker_pb2.WorkerStats(worker_id=worker_id, policy_version=0, num_running=self.running,
                                          kv_cache_free=1.0, model="fake", vocab_size=VOCAB_SIZE,
                                          max_model_len=MAX_MODEL_LEN, max_num_seqs=spec.slots, accepting=True)

    return FakeWorker()


class _Identity:
    """What ``keep_registered`` reads of a worker's servicer."""

    def __init__(self, worker_id: str):
        self.worker_id, self.version = worker_id, 0
        self.config = type("Config", (), {"vocab_size": VOCAB_SIZE, "max_position_embeddings": MAX_MODEL_LEN})()
        self.max_model_len = MAX_MODEL_LEN


async def _serve(conn, spec: FleetSpec, worker_ids: list[str]) -> None:
    from rhymerl.v1 import worker_pb2_grpc

    from services.common.grpc_server import Server
    from services.rollout.registration import keep_registered
    from services.rollout.settings import WorkerSettings

    counts: Counter = Counter()
    servers = []
    for worker_id in worker_ids:
        server = Server([(worker_pb2_grpc.add_WorkerServiceServicer_to_server, make_servicer(worker_id, spec, counts))],
                        ["rhymerl.v1.WorkerService"])
        await server.start("127.0.0.1", 0)
        servers.append((worker_id, server))
    settings = WorkerSettings(scheduler_address=spec.scheduler_address, max_num_seqs=spec.slots,
                              heartbeat_s=spec.heartbeat_s)
    beats = [asyncio.create_task(keep_registered(settings, _Identity(w), f"127.0.0.1:{s.port}")) for w, s in servers]
    loop, stop = asyncio.get_running_loop(), asyncio.Event()

    def command() -> None:
        try:
            what = conn.recv()
        except EOFError:
            what = "stop"
        if what == "stats":
            conn.send(dict(counts))
        else:
            stop.set()

    loop.add_reader(conn.fileno(), command)
    conn.send({"ready": len(servers)})
    await stop.wait()
    loop.remove_reader(conn.fileno())
    for task in beats:
        task.cancel()
    await asyncio.gather(*beats, return_exceptions=True)
    await asyncio.gather(*(s.stop(0) for _, s in servers))
    conn.send(dict(counts))


def add_channel_options(options=None) -> None:
    """Adds gRPC options to every channel this process's services open
    (``services.common.grpc_server.CHANNEL_OPTIONS``); by default those in
    $RHYMERL_BENCH_CHANNEL_OPTIONS (JSON pairs), which the control-plane benchmark sets
    for the scheduler it starts."""
    import json

    from services.common import grpc_server

    if options is None:
        options = json.loads(os.environ.get("RHYMERL_BENCH_CHANNEL_OPTIONS", "[]"))
    grpc_server.CHANNEL_OPTIONS += [(str(k), int(v)) for k, v in options]


def _process_main(conn, spec: FleetSpec, worker_ids: list[str]) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    add_channel_options(spec.channel_options)
    asyncio.run(_serve(conn, spec, worker_ids))


class FakeFleet(StartStop):
    """``spec.workers`` fake workers in ceil(workers / per_process) processes.

    Use as a context manager; ``stats()`` sums the counters of every process (batches,
    items, tokens, finished, stats, aborts)."""

    def __init__(self, spec: FleetSpec):
        self.spec = spec
        self.ids = [f"{spec.prefix}-{i:05d}" for i in range(spec.workers)]
        self.procs: list[tuple[multiprocessing.Process, object]] = []

    def start(self, timeout_s: float = 120.0) -> "FakeFleet":
        ctx = multiprocessing.get_context("spawn")
        for first in range(0, len(self.ids), self.spec.per_process):
            parent, child = ctx.Pipe()
            ids = self.ids[first:first + self.spec.per_process]
            proc = ctx.Process(target=_process_main, args=(child, self.spec, ids), daemon=True,
                               name=f"fake-fleet-{first // self.spec.per_process}")
            proc.start()
            child.close()
            self.procs.append((proc, parent))
        for proc, conn in self.procs:
            if not conn.poll(timeout_s):
                raise TimeoutError(f"{proc.name} did not start its workers in {timeout_s} s")
            conn.recv()
        return self

    def stats(self) -> Counter:
        total: Counter = Counter()
        for _, conn in self.procs:
            conn.send("stats")
        for proc, conn in self.procs:
            if not conn.poll(60):
                raise TimeoutError(f"{proc.name} did not report its counters")
            total.update(conn.recv())
        return total

    def stop(self) -> Counter:
        """Stops every process; returns the final counters of those that answered."""
        total: Counter = Counter()
        for proc, conn in self.procs:
            try:
                conn.send("stop")
            except (BrokenPipeError, OSError):
                pass
        for proc, conn in self.procs:
            try:
                if conn.poll(30):
                    total.update(conn.recv())
            except (EOFError, OSError):
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs.clear()
        return total

    def pids(self) -> list[int]:
        return [proc.pid for proc, _ in self.procs]
