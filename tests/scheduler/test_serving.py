"""Which version the fleet serves after a restart: never one that would mix versions
inside a sample, never pulled down by a worker restarted on its initial weights."""

from __future__ import annotations

from services.scheduler.serving import SETTLE_S, ServingVersion


def test_a_fresh_scheduler_learns_the_newest_version_its_workers_register():
    v = ServingVersion()
    assert not v.on_register(0, nobody_serves=True, now=0.0)
    assert v.on_register(3, nobody_serves=False, now=1.0) and v.version == 3
    assert not v.on_register(5, nobody_serves=False, now=SETTLE_S + 2)  # settled by then: v5 is not news
    assert v.version == 3


def test_a_recorded_version_holds_against_workers_on_others():
    v = ServingVersion()
    v.restore(5)
    assert not v.on_register(0, nobody_serves=True, now=0.0)  # restarted on its initial weights: stale
    assert not v.on_register(5, nobody_serves=True, now=0.5)
    assert not v.on_register(6, nobody_serves=False, now=1.0)  # v5 serves: switching would mix versions
    assert v.version == 5


def test_a_recorded_version_nobody_serves_gives_way():
    v = ServingVersion()
    v.restore(5)
    assert v.on_register(6, nobody_serves=True, now=0.0) and v.version == 6  # a push the record missed
    old = ServingVersion()
    old.restore(57)  # the record of an earlier deployment; this fleet serves v0
    assert not old.on_register(0, nobody_serves=True, now=0.0)
    assert not old.settle([0, 0], nobody_serves=True, now=SETTLE_S / 2)
    assert old.settle([0, 0], nobody_serves=True, now=SETTLE_S + 1) and old.version == 0


def test_a_push_settles_it():
    v = ServingVersion()
    v.on_register(0, nobody_serves=True, now=0.0)
    v.pushed(1)
    assert not v.on_register(4, nobody_serves=False, now=0.5) and v.version == 1
