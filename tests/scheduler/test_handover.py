"""A huge step reaches the policy in slices (core ``_hand_to_policy``): the event loop
serves other calls in between, a cancel or a shutdown in between leaves nothing queued
and nothing handed over after it, and a step handed over in slices queues exactly as if
it came whole. Ordering is asserted on recorded events, never on time."""

from __future__ import annotations

import asyncio

import pytest
from rhymerl.v1 import common_pb2

from services.scheduler.length_model import LengthModel
from services.scheduler.policies import make_policy
from services.scheduler.policies.base import WorkerState
from tests.aio import run_async
from tests.scheduler.fake_workers import FakeLink, collect, make_core, step
from tests.scheduler.test_policies import POLICY_CONFIGS, make_requests

pytestmark = pytest.mark.timeout(300)
HUGE = {f"p{i}": [3, 4 + i % 50] for i in range(16)}  # x 2,048 samples: 32,768
N = 2048


def record_slices(core, events: list) -> None:
    """Wraps the policy's handover: every slice it yields is an event."""
    real = core.policy.add_step_in_slices

    def spy(requests, lengths, now, slice_size):
        for handed in real(requests, lengths, now, slice_size):
            events.append(("slice", requests[0].step_id, handed))
            yield handed

    core.policy.add_step_in_slices = spy


def slices_of(events, step_id):
    return [i for i, e in enumerate(events) if e[:2] == ("slice", step_id)]


@run_async
async def test_other_calls_are_served_while_a_huge_step_is_handed_over():
    core = make_core(FakeLink(), handover_slice=1024)
    core.paused = True  # nothing runs: the handover alone is observed
    events: list = []
    record_slices(core, events)
    huge = asyncio.create_task(core.submit(step("huge", HUGE, n=N)))
    while not slices_of(events, "huge"):
        await asyncio.sleep(0)
    events.append(("probe",))  # this coroutine ran: so would a health check
    small = await core.submit(step("small", {"q": [5, 6]}, n=2))
    events.append(("small submitted",))
    run = await huge
    last_huge = slices_of(events, "huge")[-1]
    assert events.index(("probe",)) < last_huge and events.index(("small submitted",)) < last_huge
    assert events[last_huge][2] == 16 * N and core.policy.num_queued() == 16 * N + 2
    core.paused = False
    core.wake()
    assert len((await collect(small))[0]) == 2
    assert await core.cancel("huge") == 16 * N
    samples, _ = await collect(run)
    assert len({(s.prompt_id, s.sample_index) for s in samples}) == len(samples) == 16 * N
    await core.stop()


@pytest.mark.parametrize("policy", ["seer", "rhymerl"])
@run_async
async def test_a_cancel_mid_handover_leaves_nothing_queued(policy):
    core = make_core(FakeLink(), policy=policy, handover_slice=1024)
    core.paused = True
    events: list = []
    record_slices(core, events)
    huge = asyncio.create_task(core.submit(step("huge", HUGE, n=N)))
    while not any(e[:2] == ("slice", "huge") and e[2] > 0 for e in events):  # some of it is queued
        await asyncio.sleep(0)
    assert 0 < core.policy.num_queued() < 16 * N
    events.append(("cancel",))
    await core.cancel("huge")
    run = await huge
    assert not [i for i in slices_of(events, "huge") if i > events.index(("cancel",))]  # none after
    assert core.policy.num_queued() == 0
    samples, _ = await collect(run)
    assert len({(s.prompt_id, s.sample_index) for s in samples}) == len(samples) == 16 * N
    assert all(s.finish_reason == common_pb2.FINISH_REASON_ABORT for s in samples)
    assert not core.unfinished and not core.active
    await core.stop()


@run_async
async def test_a_shutdown_mid_handover_hands_nothing_over_after_it():
    core = make_core(FakeLink(), handover_slice=1024)
    core.paused = True
    events: list = []
    record_slices(core, events)
    huge = asyncio.create_task(core.submit(step("huge", HUGE, n=N)))
    while not slices_of(events, "huge"):
        await asyncio.sleep(0)
    events.append(("stop",))
    await core.stop()
    with pytest.raises(asyncio.CancelledError):
        await huge
    assert not [i for i in slices_of(events, "huge") if i > events.index(("stop",))]
    assert core.policy.num_queued() < 16 * N


@pytest.mark.parametrize("name, kwargs", POLICY_CONFIGS)
def test_a_step_handed_over_in_slices_queues_as_if_whole(name, kwargs):
    """Same queue order and chunk budgets, and for rhymerl the same sharing decision
    (here: on, from the history's runaways), whether a step comes whole or in slices."""
    def drain(slice_size: int | None):
        policy = make_policy(name, **kwargs)
        lengths = LengthModel({f"p{p}": [[3] * 15 + [200]] for p in range(4)})  # p4: no history
        requests = make_requests("s", 5, 7, max_tokens=200)
        if slice_size is None:
            policy.add_step(requests, lengths, 0.0)
        else:
            handed = list(policy.add_step_in_slices(requests, lengths, 0.0, slice_size))
            assert handed == sorted(handed) and handed[-1] == len(requests)
        assignments = policy.schedule([WorkerState("w0", 1000)], 0.0)
        return [(a.request.key, a.max_new_tokens) for a in assignments], getattr(policy, "_sharing", None)

    whole = drain(None)
    assert len(whole[0]) == 35 and drain(4) == whole and drain(1) == whole
    if name == "rhymerl":
        assert whole[1] == {"s": True}


@run_async
async def test_a_released_step_is_active_before_its_handover_runs():
    """A push's next wait (core.active) must see the steps the last one released, though
    their handover is a task that has not run yet."""
    core = make_core(FakeLink())
    core.hold_new_steps = True
    run = await core.submit(step("held", {"a": [3, 4]}, n=3))
    assert core.held == [run] and "held" not in core.active
    core.hold_new_steps = False
    core.release_held()
    assert core.active == {"held": run} and core.policy.num_queued() == 0  # handed over by its task
    samples, _ = await collect(run)
    assert len(samples) == 3
    await core.stop()
