"""Which steps a policy still serves, and which of their requests are unfinished.

Also numbers requests in arrival order (the tie-breaker every queue key ends with), and
gates late events: a result about a finished request, or about a cancelled or finished
step, is not news (the live scheduler may see both after a reconnect).
"""

from __future__ import annotations

from services.scheduler.policies.base import Request


class StepBook:
    """A request's arrival number is its ``arrival`` field (-1 once finished), not an
    entry of a dict of every unfinished request (a 65,536-sample step's 4.5 MB)."""

    def __init__(self) -> None:
        self._num_unfinished: dict[str, int] = {}
        self._num_arrived = 0

    def add(self, requests: list[Request]) -> None:
        counts, arrived = self._num_unfinished, self._num_arrived
        for request in requests:
            counts[request.step_id] = counts.get(request.step_id, 0) + 1
            request.arrival = arrived
            arrived += 1
        self._num_arrived = arrived

    def arrival(self, request: Request) -> int:
        """Its place in arrival order, over all steps."""
        if request.arrival < 0:
            raise KeyError(request.key)
        return request.arrival

    def is_live(self, request: Request) -> bool:
        """False for requests of cancelled or finished steps: late events about them are ignored."""
        return request.step_id in self._num_unfinished

    def accepts(self, request: Request) -> bool:
        """Whether a chunk result for ``request`` is news: it is unfinished and its step
        is live. A late one is forgotten."""
        if request.arrival >= 0 and request.step_id in self._num_unfinished:
            return True
        request.arrival = -1
        return False

    def finish(self, request: Request) -> bool:
        """Count one finished request; True when it was its step's last."""
        request.arrival = -1
        left = self._num_unfinished[request.step_id] - 1
        if left:
            self._num_unfinished[request.step_id] = left
            return False
        del self._num_unfinished[request.step_id]
        return True

    def cancel(self, step_id: str) -> None:
        """Its requests are no longer accepted (``accepts`` checks their step)."""
        self._num_unfinished.pop(step_id, None)

    def live_steps(self) -> list[str]:
        return list(self._num_unfinished)
