"""HistoryBreaker: what a hung history may cost a step.

History is an optimisation, never a failure: the history calls a step waits for (the
scheduler's length lookup, a worker's lookups of earlier epochs and recent responses)
get a short deadline, and after one timed out they are skipped for a while instead of
each paying the deadline again (docs/architecture.md, "A hung history"). No numpy, no
protos: the scheduler imports it at start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

__all__ = ["HistoryBreaker", "HistorySkipped", "HistoryTimeout"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class HistorySkipped(Exception):
    """A read not tried: history timed out lately and the breaker's backoff runs."""


class HistoryTimeout(TimeoutError):
    """A read history did not answer within the breaker's deadline."""


class HistoryBreaker:
    """Bounds the history reads a step waits for, and skips them while history hangs.

    ``read(call)`` waits at most ``timeout_s`` for ``call()`` (HistoryTimeout past it; the
    call is cancelled). A read that times out opens the breaker: reads are then skipped
    at once (HistorySkipped, ``call`` not made) for ``first_backoff_s``; then one read
    probes (the others meanwhile still skipped): if it answers, the breaker closes; if
    it times out, reads are skipped twice as long as before, up to ``max_backoff_s``.
    Any answer closes it, a write's too (``answered``). Other failures (UNAVAILABLE: a
    dead history fails fast) open nothing; callers carry on without history either way.

    Logged: one WARNING per outage (the first failure since history last answered), an
    INFO line when it answers again; the failures in between at DEBUG.

    Args:
        timeout_s: the deadline of each read.
        first_backoff_s, max_backoff_s: reads skipped this long after a first timeout,
            doubling up to the cap while probes time out.
        clock: monotonic seconds (tests pass a fake).
        name: in the log lines (which service's reads).
    """

    def __init__(self, timeout_s: float = 2.0, *, first_backoff_s: float = 5.0, max_backoff_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic, name: str = "history"):
        if timeout_s <= 0 or first_backoff_s <= 0 or max_backoff_s < first_backoff_s:
            raise ValueError(f"HistoryBreaker: timeout_s {timeout_s} and first_backoff_s {first_backoff_s} must be "
                             f"> 0, max_backoff_s {max_backoff_s} >= first_backoff_s")
        self.timeout_s = timeout_s
        self.first_backoff_s, self.max_backoff_s = first_backoff_s, max_backoff_s
        self.clock, self.name = clock, name
        self.backoff_s = 0.0  # the current skip period; 0: closed
        self._skip_until = 0.0
        self._probing = False
        self._outage_since: float | None = None  # the first failure since history last answered
        self._skipped_in_outage = 0
        self.num_timeouts = 0
        self.num_skipped = 0  # reads not tried
        self.num_calls = 0  # reads tried

    @property
    def is_open(self) -> bool:
        """True while reads are skipped (a timeout lately, its backoff running, or a probe
        in flight)."""
        return self.backoff_s > 0 and (self._probing or self.clock() < self._skip_until)

    async def read(self, call: Callable[[], Awaitable[T]], what: str = "read") -> T:
        """``await call()`` within ``timeout_s``; HistorySkipped without calling while open."""
        probe = False
        if self.backoff_s > 0:
            if self.is_open:
                self.num_skipped += 1
                self._skipped_in_outage += 1
                raise HistorySkipped(f"{self.name}: {what} skipped (history timed out lately)")
            self._probing = probe = True
        self.num_calls += 1
        try:
            result = await asyncio.wait_for(call(), self.timeout_s)
        except (TimeoutError, asyncio.TimeoutError) as exc:  # (one class since Python 3.11)
            self.failed(exc, what)
            raise HistoryTimeout(f"{self.name}: {what} got no answer within {self.timeout_s:g} s") from None
        except Exception as exc:
            self.failed(exc, what)
            raise
        finally:
            if probe:
                self._probing = False
        self.answered()
        return result

    def answered(self) -> None:
        """History answered (a read, or a write): the breaker closes."""
        if self._outage_since is not None:
            log.info("%s: history answers again, after %.1f s (%d reads skipped meanwhile)", self.name,
                     self.clock() - self._outage_since, self._skipped_in_outage)
        self._outage_since, self._skipped_in_outage = None, 0
        self.backoff_s = 0.0

    def failed(self, exc: BaseException, what: str = "call") -> None:
        """A call to history failed; a timeout (ours, or gRPC's DEADLINE_EXCEEDED) opens the
        breaker, or doubles its backoff."""
        timed_out = isinstance(exc, TimeoutError) or (
            isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
        now = self.clock()
        if timed_out:
            self.num_timeouts += 1
            self.backoff_s = min(self.max_backoff_s, self.backoff_s * 2) if self.backoff_s else self.first_backoff_s
            self._skip_until = now + self.backoff_s
        why = f"no answer within {self.timeout_s:g} s" if isinstance(exc, TimeoutError) else \
            f"{type(exc).__name__}: {_short(exc)}"
        if self._outage_since is None:
            self._outage_since = now
            if timed_out:
                log.warning("%s: history %s failed (%s): steps go on without history; its reads are skipped for "
                            "%g s, then tried again (backing off up to %g s) until it answers", self.name, what,
                            why, self.backoff_s, self.max_backoff_s)
            else:
                log.warning("%s: history %s failed (%s): steps go on without history until it answers",
                            self.name, what, why)
        else:
            log.debug("%s: history %s failed again (%s)%s", self.name, what, why,
                      f"; reads skipped for {self.backoff_s:g} s" if timed_out else "")


def _short(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name} {exc.details()}"
    return str(exc)
