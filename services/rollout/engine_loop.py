"""Runs the engine's step loop in its own thread and bridges it to asyncio.

The engine is single-threaded and knows nothing of gRPC; the servicer knows
nothing of batching. Commands (add, abort, call, call-when-idle, deferred call) go to
the thread through a queue and are applied between steps; each finished chunk comes
back to the caller's asyncio queue. A deferred call (``call_deferred``: work no step
waits for, the drafter's feed) runs at once if the engine has nothing to do, else where
it delays no forward: handed to the engine's ``defer`` (behind the next forward's
launch, paced by its cost), or, for an engine without one (vLLM's), between steps,
paced the same way.

A failed engine step must not fail every request that shared the batch with the
one that broke it (a "poison" request). The loop drops the batch and re-runs it
in halves, alone (new requests wait): a half that completes delivers its chunks,
a half that fails is halved again, and a request that fails on its own gets the
error. Seeds make the re-run produce the same tokens, so nothing but time is lost:
about 2 log2(batch) chunk runs for one poison request.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from services.common import metrics
from services.rollout.engine.deferred import DEFERRED_COST_PER_STEP, DeferredCalls

log = logging.getLogger(__name__)


class AbortedChunk:
    """Delivered instead of an output when a request was aborted mid-chunk."""

    def __init__(self, request_id: str):
        self.request_id = request_id


class ItemFailed:
    """Delivered instead of an output when the engine failed on this request alone."""

    def __init__(self, request_id: str, error: Exception):
        self.request_id = request_id
        self.error = error


class EngineLoop:
    """``deferred_cost_per_step``: for an engine without ``defer``, the cost of deferred
    calls run between two steps (an engine with it paces them itself)."""

    def __init__(self, engine, worker_id: str, loop: asyncio.AbstractEventLoop,
                 deferred_cost_per_step: int = DEFERRED_COST_PER_STEP):
        self.engine = engine
        self.worker_id = worker_id
        self._loop = loop
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, asyncio.Queue] = {}
        self._requests: dict[str, Any] = {}   # in the engine: request_id -> EngineRequest
        self._held: list[tuple] = []          # adds waiting while an idle call or isolation is pending
        self._suspects: deque[list[tuple]] = deque()  # (request, sink) groups to re-run alone
        self._isolating = False               # a suspect group is in the engine
        self._idle_calls: list[tuple[Callable, asyncio.Future]] = []
        # deferred calls for an engine without ``defer``: run between steps, paced
        self._between = DeferredCalls()
        self._between_cost = deferred_cost_per_step
        self._defer = getattr(engine, "defer", None)
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"engine-{worker_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    # --- called from the event loop ------------------------------------------
    def submit(self, request, sink: asyncio.Queue) -> None:
        """Queues an EngineRequest; its RequestOutput (or an exception) goes to ``sink``."""
        self._send(("add", request, sink))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def call_when_idle(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` in the engine thread once no request is in flight; new
        requests wait meanwhile (weight updates never mix inside a sample)."""
        future = self._loop.create_future()
        self._send(("idle_call", fn, future))
        return await future

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs ``fn`` in the engine thread between two steps."""
        future = self._loop.create_future()
        self._send(("call", fn, future))
        return await future

    def call_deferred(self, fn: Callable[[], Any], cost: int = 0, urgent: bool = False) -> asyncio.Future:
        """Runs ``fn`` in the engine thread where it delays no step (the module
        docstring), ``cost`` its share of a step's budget (for the drafter's feed, its
        tokens); ``urgent``: right after the next step's launch, ahead of the paced calls
        (work requests wait for: ``LLMEngine.defer``). Sent now, in order with the other
        commands; returns the future of its result (never awaited by a step)."""
        if cost < 0:
            raise ValueError(f"cost: {cost} is negative")
        future = self._loop.create_future()
        self._send(("deferred", fn, future, cost, urgent))
        return future

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks) + len(self._held) + sum(map(len, self._suspects))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    # --- the engine thread ------------------------------------------------------
    def _run(self) -> None:
        last = time.monotonic()
        while not self._stopped:
            self._apply_commands()
            busy = self.engine.has_unfinished()
            if busy:
                self._step()
            elif self._suspects:
                self._run_next_suspects()
            else:
                self._isolating = False  # the last suspect group is done
                if self._between:
                    self._between.run()  # (left by a step that failed)
                if self._idle_calls:
                    self._run_idle_calls()
                elif self._held:
                    self._release_held()
                else:
                    self._wakeup.wait(timeout=0.05)
                    self._wakeup.clear()
            now = time.monotonic()
            (metrics.worker_busy_seconds if busy else metrics.worker_idle_seconds).labels(
                worker=self.worker_id).inc(now - last)
            last = now

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add" and (self._idle_calls or self._suspects or self._isolating):
                self._held.append(command)
            elif kind == "add":
                self._add(command[1], command[2])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "idle_call":
                self._idle_calls.append((command[1], command[2]))
            elif kind == "call":
                self._resolve(command[2], command[1])
            elif kind == "deferred":
                self._deferred(*command[1:])

    def _deferred(self, fn: Callable[[], Any], future: asyncio.Future, cost: int, urgent: bool) -> None:
        call = functools.partial(self._resolve, future, fn)
        if not self.engine.has_unfinished():
            call()  # nothing to delay
        elif self._defer is not None:
            self._defer(call, cost, urgent)
        else:
            self._between.add(call, cost, urgent)

    def _add(self, request, sink: asyncio.Queue) -> None:
        try:
            self.engine.add_request(request)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller as this item's error
            self._loop.call_soon_threadsafe(sink.put_nowait, ItemFailed(request.request_id, exc))
            return
        self._sinks[request.request_id] = sink
        self._requests[request.request_id] = request

    def _abort(self, request_id: str) -> None:
        sink = None
        for c in [c for c in self._held if c[1].request_id == request_id]:
            self._held.remove(c)
            sink = c[2]
        for group in self._suspects:
            for entry in [e for e in group if e[0].request_id == request_id]:
                group.remove(entry)
                sink = entry[1]
        if request_id in self._sinks:
            self.engine.abort(request_id)
            self._requests.pop(request_id, None)
            sink = self._sinks.pop(request_id)
        if sink is not None:
            self._loop.call_soon_threadsafe(sink.put_nowait, AbortedChunk(request_id))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - isolate the request that broke it, keep serving
            log.exception("engine step failed with %d requests in flight", len(self._sinks))
            self._isolate(exc)
            return
        self._deliver(outputs)
        if self._between:
            self._between.run(self._between_cost if self.engine.has_unfinished() else None)

    def _isolate(self, exc: Exception) -> None:
        """Drops the failed batch; a lone request gets the error, a larger batch is
        queued again in two halves that run alone (see the module docstring)."""
        batch = [(self._requests[rid], sink) for rid, sink in self._sinks.items()]
        self._sinks.clear()
        self._requests.clear()
        try:
            self.engine.reset()
        except Exception:  # noqa: BLE001 - the engine is beyond repair: fail everything
            log.exception("engine reset failed")
            self._fail(batch + [entry for group in self._suspects for entry in group], exc)
            self._suspects.clear()
            return
        metrics.worker_step_failures.labels(worker=self.worker_id).inc()
        if len(batch) == 1:
            request, sink = batch[0]
            log.error("request %s fails every step it is in: %s", request.request_id, exc)
            self._loop.call_soon_threadsafe(sink.put_nowait, ItemFailed(request.request_id, exc))
            return
        half = len(batch) // 2
        self._suspects.appendleft(batch[half:])
        self._suspects.appendleft(batch[:half])

    def _run_next_suspects(self) -> None:
        group = self._suspects.popleft()
        self._isolating = True
        for request, sink in group:
            self._add(request, sink)

    def _fail(self, entries: list[tuple], exc: Exception) -> None:
        for request, sink in entries:
            self._loop.call_soon_threadsafe(sink.put_nowait, exc)

    def _release_held(self) -> None:
        held, self._held = self._held, []
        for _, request, sink in held:
            self._add(request, sink)

    def _deliver(self, outputs) -> None:
        for out in outputs:
            sink = self._sinks.pop(out.request_id, None)
            self._requests.pop(out.request_id, None)
            if sink is not None:
                self._loop.call_soon_threadsafe(sink.put_nowait, out)

    def _run_idle_calls(self) -> None:
        calls, self._idle_calls = self._idle_calls, []
        for fn, future in calls:
            self._resolve(future, fn)
        self._release_held()

    def _resolve(self, future: asyncio.Future, fn: Callable[[], Any]) -> None:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001
            self._loop.call_soon_threadsafe(_set_exception, future, exc)
        else:
            self._loop.call_soon_threadsafe(_set_result, future, result)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
