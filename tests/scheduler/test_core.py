"""The scheduler core against in-process fake workers: the step lifecycle, retries, fair
sharing, admission, identity and the step log, without gRPC and without a model."""

from __future__ import annotations

import asyncio
import time

import pytest
from rhymerl.v1 import common_pb2

from services.common.errors import FailedPrecondition, ResourceExhausted
from services.scheduler.fair_share import max_min_shares, step_quotas
from services.scheduler.step_log import StepLog
from services.scheduler.step_table import StepTable
from tests.aio import run_async
from tests.scheduler.fake_workers import FakeLink, collect, expected_tokens, make_core, step

pytestmark = pytest.mark.timeout(120)
PROMPTS = {"a": [3, 4, 5], "b": [6, 7], "c": [8, 9, 10, 11]}


def keys(samples) -> list[tuple[str, int]]:
    return sorted((s.prompt_id, s.sample_index) for s in samples)


@pytest.mark.parametrize("policy", ["static", "seer", "histopipe", "rhymerl"])
@run_async
async def test_every_sample_once_with_its_seeded_tokens(policy):
    """Chunks (4 tokens each) may run on either worker: each sample comes back once, with
    the tokens its seed fixes, and the summary counts them."""
    link = FakeLink()
    core = make_core(link, policy=policy)
    samples, summary = await collect(await core.submit(step("s", PROMPTS, n=3)))
    assert keys(samples) == [(p, k) for p in sorted(PROMPTS) for k in range(3)]
    for s in samples:
        assert list(s.token_ids) == expected_tokens(s, 20) and len(s.logprobs) == len(s.token_ids)
    assert summary.num_samples == 9 and summary.num_generated_tokens == link.generated
    assert not core.unfinished and all(not w.state.running for w in core.workers.workers.values())
    await core.stop()


@run_async
async def test_ids_that_collide_when_joined_stay_apart():
    """Step "X/a" + prompt "b" and step "X" + prompt "a/b": a joined id is equal for both."""
    core = make_core(FakeLink())
    first = await core.submit(step("X/a", {"b": [3, 4]}, n=2))
    second = await core.submit(step("X", {"a/b": [3, 4]}, n=2))
    (got1, _), (got2, _) = await asyncio.gather(collect(first), collect(second))
    assert keys(got1) == [("b", 0), ("b", 1)] and keys(got2) == [("a/b", 0), ("a/b", 1)]
    assert {s.step_id for s in got1} == {"X/a"} and {s.step_id for s in got2} == {"X"}
    await core.stop()


@run_async
async def test_a_lost_worker_loses_no_sample_and_duplicates_none():
    link = FakeLink()
    link.die_after["w1"] = 3
    core = make_core(link, chunk_size=2)
    samples, _ = await collect(await core.submit(step("s", PROMPTS, n=4)))
    assert keys(samples) == [(p, k) for p in sorted(PROMPTS) for k in range(4)]
    assert all(list(s.token_ids) == expected_tokens(s, 20) for s in samples)
    assert not core.workers.workers["w1"].state.healthy
    await core.stop()


@run_async
async def test_a_late_result_of_a_re_run_chunk_is_ignored():
    """The watchdog declares a worker lost while its chunk still runs; the chunk re-runs
    elsewhere. When the first run's result arrives anyway, it must not add its tokens.
    Chunks of 2 tokens: the stale result then carries other tokens than the re-run's (with
    one chunk for the whole sample both would carry the same ones and hide a missing check)."""
    link = FakeLink()
    link.gate = asyncio.Event()
    core = make_core(link, workers=1, capacity=1, chunk_size=2)
    run = await core.submit(step("s", {"a": [3]}, n=1))
    while not core.runs.num_chunks:
        await asyncio.sleep(0)
    [prog] = core.unfinished.values()
    first_dispatch = prog.dispatch_id
    core.runs._release(core.workers.workers["w0"], run, prog, 0.0)  # as if re-queued after a loss...
    core.policy.on_worker_lost("w0", [prog.request], 0.0)
    core.wake()
    while prog.dispatch_id in (None, first_dispatch):  # ...and sent again
        await asyncio.sleep(0)
    link.gate.set()
    samples, _ = await collect(run)
    assert [list(s.token_ids) for s in samples] == [expected_tokens(samples[0], 20)]
    await core.stop()


@run_async
async def test_an_engine_failure_is_retried_then_given_up_alone():
    link = FakeLink()
    link.poison.add("b")
    core = make_core(link, max_attempts=3)
    samples, _ = await collect(await core.submit(step("s", PROMPTS, n=2)))
    by_key = {(s.prompt_id, s.sample_index): s for s in samples}
    for k in range(2):
        assert by_key["b", k].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert "injected engine failure" in by_key["b", k].error
        assert link.chunks_started[("s", "b", k)] == 3
    for p in "ac":
        assert all(list(by_key[p, k].token_ids) == expected_tokens(by_key[p, k], 20) for k in range(2))
    await core.stop()


def test_max_min_shares():
    assert max_min_shares(8, {"big": 100, "small": 2}) == {"big": 6, "small": 2}
    assert max_min_shares(9, {"a": 100, "b": 100, "c": 100}) == {"a": 3, "b": 3, "c": 3}
    assert max_min_shares(10, {"a": 100, "b": 100, "c": 100}) == {"a": 4, "b": 3, "c": 3}
    assert max_min_shares(10, {"a": 1, "b": 1}) == {"a": 1, "b": 1}
    assert max_min_shares(1, {"a": 5, "b": 5}) == {"a": 1, "b": 0}


def as_lists(quotas):
    return None if quotas is None else [(s, q.as_dict()) for s, q in quotas]


def test_work_conserving_quotas_give_the_big_step_what_the_small_one_leaves():
    def quotas(running, queued):
        return as_lists(step_quotas(8, running, queued, "work_conserving"))

    assert quotas({"big": 8}, {"big": 90}) is None  # alone: every free slot
    assert quotas({"big": 8, "small": 0}, {"big": 90, "small": 2}) == [("small", {"small": 2})]  # big over share
    assert quotas({"big": 2, "small": 0}, {"big": 90, "small": 2}) == [("small", {"small": 2}), ("big", {"big": 4})]
    assert quotas({"big": 2, "small": 2}, {"big": 90, "small": 0}) is None  # only big waits: every free slot


def test_equal_quotas_hold_each_step_to_an_equal_split_while_several_run():
    def quotas(running, queued, slots=8):
        return as_lists(step_quotas(slots, running, queued, "equal"))

    assert quotas({"big": 8}, {"big": 90}) is None  # alone: every free slot
    assert quotas({"big": 2}, {"big": 90, "done": 0}) is None  # a step with nothing left shares nothing
    assert quotas({"big": 8, "small": 0}, {"big": 90, "small": 2}) == [("small", {"small": 2})]
    # the small step's unused half stays free: big gets 4 of 8, not 6
    assert quotas({"big": 2, "small": 0}, {"big": 90, "small": 2}) == [("small", {"small": 2}), ("big", {"big": 2})]
    # the small step's samples all run: big still waits for nothing beyond its half
    assert quotas({"big": 2, "small": 2}, {"big": 90, "small": 0}) == [("big", {"big": 2})]
    assert quotas({"big": 4, "small": 2}, {"big": 90, "small": 0}) == []
    # three steps, 10 slots: 4, 3, 3 (the remainder to the oldest)
    assert quotas({}, {"a": 90, "b": 90, "c": 1}, slots=10) == [("a", {"a": 4}), ("b", {"b": 3}), ("c", {"c": 1})]
    # fewer slots than steps: the older ones get one each, the newest waits for one to end
    assert quotas({}, {"a": 5, "b": 5, "c": 5}, slots=2) == [("a", {"a": 1}), ("b", {"b": 1})]


def test_matched_quotas_hold_a_step_to_the_largest_other_steps_size():
    def quotas(running, queued, sizes=None, slots=64):
        return as_lists(step_quotas(slots, running, queued, "matched", sizes))

    assert as_lists(step_quotas(64, {"big": 2}, {"big": 90})) is None  # the default mode; alone: every slot
    # beside a 4-sample step (all 4 running), the huge one runs 4 chunks, not 32 or 60
    assert quotas({"big": 0, "small": 4}, {"big": 900, "small": 0}, {"big": 904, "small": 4}) == [("big", {"big": 4})]
    # the small step's tail (1 sample left of 4): still its size, so the huge one keeps 4
    assert quotas({"big": 4, "small": 1}, {"big": 900, "small": 0}, {"big": 904, "small": 4}) == []
    # a huge step's tail does not shrink another huge one below the equal split
    assert quotas({"a": 1, "b": 0}, {"a": 0, "b": 900}, {"a": 5000, "b": 900}) == [("b", {"b": 32})]
    # steps of similar size: the equal split
    assert quotas({}, {"a": 100, "b": 100}) == [("a", {"a": 32}), ("b", {"b": 32})]
    # three steps: each held to the largest of the others (and to the equal split)
    assert quotas({}, {"a": 900, "b": 10, "c": 3}) == [("a", {"a": 10}), ("b", {"b": 10}), ("c", {"c": 3})]


def test_unknown_fair_share_mode_is_refused():
    with pytest.raises(ValueError):
        step_quotas(8, {}, {"a": 1}, "greedy")


@pytest.mark.parametrize("policy", ["static", "seer", "histopipe", "rhymerl"])
@run_async
async def test_a_small_step_gets_its_share_beside_a_huge_one(policy):
    """Every slot runs the huge step when the small one arrives: the small step's samples
    start as soon as chunks end, not after the huge step's queue. Counted in chunks sent,
    not in time: both small samples start before the huge step gets another fleet's
    worth (8 slots) of chunks."""
    link = FakeLink()
    link.gate = asyncio.Event()
    core = make_core(link, capacity=4, policy=policy, chunk_size=2)
    big = await core.submit(step("big", {f"p{i}": [3, i + 4] for i in range(8)}, n=64, max_tokens=40))
    while core.runs.num_chunks < 8:
        await asyncio.sleep(0)
    small = await core.submit(step("small", {"q": [5, 5]}, n=2, max_tokens=40, seed=3))
    sent_before = len(link.start_order)
    link.gate.set()
    samples, _ = await collect(small)
    assert len(samples) == 2
    after = [key.step_id for key in link.start_order[sent_before:]]
    first_starts = [i for i, s in enumerate(after) if s == "small"][:2]
    assert len(first_starts) == 2 and after[:first_starts[1]].count("big") < 8, "the small step waited for the huge one"
    await core.cancel("big")
    await collect(big)
    await core.stop()


@run_async
async def test_admission_bounds_samples_in_flight():
    link = FakeLink()
    link.gate = asyncio.Event()
    core = make_core(link, max_samples_in_flight=10)
    first = await core.submit(step("first", {"a": [3]}, n=8))
    with pytest.raises(ResourceExhausted) as err:
        await core.submit(step("second", {"b": [3]}, n=3))
    assert err.value.field == "prompts" and "second" not in core.steps
    link.gate.set()
    await collect(first)
    assert len((await collect(await core.submit(step("second", {"b": [3]}, n=3))))[0]) == 3
    await core.stop()


@run_async
async def test_finished_steps_are_retained_within_count_and_size():
    """Retained finished steps bound memory: the oldest go first, by count and by bytes."""
    core = make_core(FakeLink(), steps=StepTable(max_retained=2, max_retained_bytes=1 << 30))
    for i in range(3):
        await collect(await core.submit(step(f"s{i}", {"a": [3]}, n=2)))
    assert [r.step_id for r in core.steps] == ["s1", "s2"]
    core.steps.max_retained_bytes = core.steps.get("s2").num_bytes  # room for one step's samples
    await collect(await core.submit(step("s3", {"a": [3]}, n=2)))
    assert [r.step_id for r in core.steps] == ["s3"]
    await core.stop()


@run_async
async def test_cancel_ends_queued_and_running_samples():
    link = FakeLink()
    link.gate = asyncio.Event()
    core = make_core(link, workers=1, capacity=2)
    run = await core.submit(step("s", {"a": [3], "b": [4]}, n=4))
    while core.runs.num_chunks < 2:
        await asyncio.sleep(0)
    assert await core.cancel("s") == 8
    assert len(link.aborted) == 2
    link.gate.set()
    samples, summary = await collect(run)
    assert len(samples) == 8 and summary.num_samples == 8
    assert sum(s.finish_reason == common_pb2.FINISH_REASON_ABORT for s in samples) >= 6
    await core.stop()


@run_async
async def test_a_step_resubmitted_while_its_cancel_ends_is_run_again_not_joined():
    """The cancel returns before the workers report the aborts of the running samples; a
    resubmission meanwhile must not join the cancelled run (all ABORT) but run it again
    once it has ended: every sample generated, with its seeded tokens."""
    link = FakeLink()
    link.gate = asyncio.Event()
    core = make_core(link, workers=1, capacity=2)
    first = await core.submit(step("s", {"a": [3], "b": [4]}, n=2))
    while core.runs.num_chunks < 2:
        await asyncio.sleep(0)
    assert await core.cancel("s") == 4
    again = asyncio.ensure_future(core.submit(step("s", {"a": [3], "b": [4]}, n=2)))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not again.done() and not first.is_finished  # waits for the cancelled run's aborts
    link.gate.set()
    samples, _ = await collect(await again)
    assert keys(samples) == [(p, k) for p in ("a", "b") for k in range(2)]
    assert all(s.finish_reason != common_pb2.FINISH_REASON_ABORT for s in samples)
    assert all(list(s.token_ids) == expected_tokens(s, 20) for s in samples)
    await core.stop()


@run_async
async def test_a_step_no_trainer_follows_is_cancelled_after_the_timeout_then_run_again():
    """A trainer that went (its stream closed) leaves the step unfollowed: after
    ``abandoned_step_timeout_s`` it is cancelled as CancelStep does (its slots freed);
    resubmitting the id then generates what the cancel aborted."""
    link = FakeLink()
    link.gate = asyncio.Event()
    core = make_core(link, workers=1, capacity=2, abandoned_step_timeout_s=60.0)
    run = await core.submit(step("s", {"a": [3], "b": [4]}, n=2))
    follower = asyncio.ensure_future(collect(run))
    while core.runs.num_chunks < 2 or not run.num_followers:
        await asyncio.sleep(0)
    assert core.cancel_abandoned(time.monotonic() + 1e6) == []  # followed: never
    follower.cancel()  # the trainer's call ends
    with pytest.raises(asyncio.CancelledError):
        await follower
    assert run.num_followers == 0 and run.unfollowed_since is not None
    assert core.cancel_abandoned(run.unfollowed_since + 59.0) == []
    assert core.cancel_abandoned(run.unfollowed_since + 61.0) == ["s"]
    link.gate.set()
    samples, _ = await collect(run)
    assert run.cancelled and len(run.aborted) == 4
    assert all(s.finish_reason == common_pb2.FINISH_REASON_ABORT and "abandoned_step_timeout_s" in s.error
               for s in samples)
    again, _ = await collect(await core.submit(step("s", {"a": [3], "b": [4]}, n=2)))
    assert all(s.finish_reason != common_pb2.FINISH_REASON_ABORT for s in again) and len(again) == 4
    assert core.cancel_abandoned(time.monotonic() + 1e6) == []  # finished steps are not touched
    await core.stop()


@run_async
async def test_a_zero_abandoned_step_timeout_never_cancels():
    core = make_core(FakeLink(), abandoned_step_timeout_s=0.0)
    run = await core.submit(step("s", {"a": [3]}, n=2))
    assert core.cancel_abandoned(time.monotonic() + 1e9) == [] and not run.cancelled
    await collect(run)
    await core.stop()


@run_async
async def test_same_step_id_joins_and_other_content_is_refused():
    core = make_core(FakeLink())
    runs = await asyncio.gather(*(core.submit(step("dup", PROMPTS, n=2)) for _ in range(5)))
    assert len({id(r) for r in runs}) == 1
    with pytest.raises(FailedPrecondition):
        await core.submit(step("dup", PROMPTS, n=3))
    assert len((await collect(runs[0]))[0]) == 6
    await core.stop()


@run_async
async def test_queued_work_without_any_worker_is_aborted_not_left_hanging():
    core = make_core(FakeLink(), no_worker_timeout_s=0.0)
    run = await core.submit(step("s", {"a": [3]}, n=2))
    for w in core.workers.workers.values():
        core.worker_lost(w)
    core.abort_if_no_workers()
    core.abort_if_no_workers()
    samples, _ = await collect(run)
    assert all(s.finish_reason == common_pb2.FINISH_REASON_ABORT and "no worker" in s.error for s in samples)
    await core.stop()


@run_async
async def test_a_resubmitted_step_after_a_restart_replays_its_log_and_generates_only_the_rest(clean_redis):
    """A scheduler dies mid-step; a new one (same Redis) gets the same step id: the samples
    the first one finished are replayed, the others generated, each delivered once."""
    link = FakeLink()
    link.die_after["w0"] = link.die_after["w1"] = 3  # each worker: 3 chunks, then silence
    first = make_core(link, redis_url=clean_redis, chunk_size=100)
    run = await first.submit(step("s", PROMPTS, n=4))
    while first.runs.num_chunks:
        await asyncio.sleep(0.01)
    await first.stop()
    seen = {(e.sample.prompt_id, e.sample.sample_index) for e in run.events}  # what the trainer saw
    log_reader = StepLog(clean_redis)
    logged = {(s.prompt_id, s.sample_index) for s in (await log_reader.load("s")).samples}
    await log_reader.shutdown()
    assert seen <= logged and 0 < len(logged) < 12  # logged before it is sent

    link2 = FakeLink()
    second = make_core(link2, redis_url=clean_redis, chunk_size=100)
    samples, summary = await collect(await second.submit(step("s", PROMPTS, n=4)))
    assert keys(samples) == [(p, k) for p in sorted(PROMPTS) for k in range(4)]
    assert all(list(s.token_ids) == expected_tokens(s, 20) for s in samples)
    assert set(link2.chunks_started) == {("s", p, k) for p in PROMPTS for k in range(4)} - {
        ("s", p, k) for p, k in logged}  # only what the log lacks is generated
    assert summary.num_samples == 12
    third = make_core(FakeLink(), redis_url=clean_redis)  # a finished step: replayed whole
    again, _ = await collect(await third.submit(step("s", PROMPTS, n=4)))
    assert {(s.prompt_id, s.sample_index): list(s.token_ids) for s in again} == \
        {(s.prompt_id, s.sample_index): list(s.token_ids) for s in samples}
    with pytest.raises(FailedPrecondition):
        await third.submit(step("s", PROMPTS, n=5))
    for core in (second, third):
        await core.stop()
        await core.log.shutdown()
