"""Which steps a policy still serves: how many of their requests are unfinished."""

from __future__ import annotations

from services.scheduler.policies.base import Request


class StepBook:
    def __init__(self) -> None:
        self._num_unfinished: dict[str, int] = {}

    def add(self, requests: list[Request]) -> None:
        for request in requests:
            self._num_unfinished[request.step_id] = self._num_unfinished.get(request.step_id, 0) + 1

    def is_live(self, request: Request) -> bool:
        """False for requests of cancelled or finished steps: late events about them are ignored."""
        return request.step_id in self._num_unfinished

    def finish(self, request: Request) -> bool:
        """Count one finished request; True when it was its step's last."""
        left = self._num_unfinished[request.step_id] - 1
        if left:
            self._num_unfinished[request.step_id] = left
            return False
        del self._num_unfinished[request.step_id]
        return True

    def cancel(self, step_id: str) -> None:
        self._num_unfinished.pop(step_id, None)

    def live_steps(self) -> list[str]:
        return list(self._num_unfinished)
