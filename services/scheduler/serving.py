"""Which policy version the fleet serves, as the scheduler knows it.

A version made serving by a push is recorded (in the step log's Redis, with its SHA-256
or the path it was loaded from), so a restarted scheduler knows it at once: a worker
registering on another version is stale (caught up from the path, or from the pushed
bytes in the weight store), never a reason to switch (switching mid-step would mix
versions inside samples). Without a record (a fresh deployment, Redis down or not
configured), the scheduler learns the version from its workers: the newest registered
within ``SETTLE_S`` of the first (a worker restarted on its initial weights must not
pull the fleet's version down). Whatever the record says, a version no registered
worker serves gives way to a newer one that registers, and, ``SETTLE_S`` after the
first worker came, to the newest registered (a record of an earlier deployment) --
unless the recorded version's pushed bytes are in the scheduler's weight store (this
deployment's: the fleet is being caught up to it). When the record could not be read
(Redis down as the scheduler started), nothing is dispatched until the version
settles: a worker restarted on its initial weights may register first, and serving it
until the fleet's newer workers come would switch versions under running samples (seen
in the fault campaign).
"""

from __future__ import annotations

SETTLE_S = 10.0


class ServingVersion:
    def __init__(self) -> None:
        self.version = 0
        self.recorded = False  # the version came from the record of a push
        self.settled = False  # a push, or the settle window passed
        self._first_worker_at: float | None = None
        self.unreadable = False  # a record may exist but could not be read
        self.catchable = False  # the recorded version's bytes are at hand: never give it up

    @property
    def dispatchable(self) -> bool:
        """Whether chunks may be sent: the version is known or settled, or there is no record to wait for."""
        return not self.unreadable or self.recorded or self.settled

    def restore(self, version: int, catchable: bool = False) -> None:
        self.version, self.recorded, self.catchable = version, True, catchable

    def pushed(self, version: int) -> None:
        self.version, self.recorded, self.settled = version, True, True

    def on_register(self, version: int, nobody_serves: bool, now: float) -> bool:
        """A worker on ``version`` registered; True when the serving version changed."""
        self._first_worker_at = self._first_worker_at or now
        learning = not self.recorded and not self.settled and now - self._first_worker_at <= SETTLE_S
        if version > self.version and (nobody_serves or learning):
            self.version = version
            return True
        return False

    def settle(self, registered: list[int], nobody_serves: bool, now: float) -> bool:
        """Called periodically; True when the serving version changed."""
        if self.settled or self._first_worker_at is None or now - self._first_worker_at <= SETTLE_S:
            return False
        self.settled = True
        if nobody_serves and registered and not self.catchable and max(registered) != self.version:
            self.version = max(registered)
            return True
        return False
