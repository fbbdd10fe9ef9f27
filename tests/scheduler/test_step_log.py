"""The step log against a real Redis: what a restarted scheduler reads back, and a Redis
restart (``test_log_outage.py``: a Redis that is down)."""

from __future__ import annotations

import asyncio

from rhymerl.v1 import rollout_pb2

from services.scheduler.step_log import StepLog, step_key
from tests.aio import run_async


def sample(prompt_id: str, k: int) -> tuple[tuple[str, int], bytes]:
    """As delivery logs a sample: its key and its SampleResult, serialized."""
    return (prompt_id, k), rollout_pb2.SampleResult(step_id="s", prompt_id=prompt_id, sample_index=k,
                                                    token_ids=[k, 5]).SerializeToString()


@run_async
async def test_what_is_logged_is_read_back_and_ids_cannot_collide(clean_redis):
    log = StepLog(clean_redis)
    await log.open("X/a", "fp1", ["b"], 2)
    await log.open("X", "fp2", ["a/b"], 2)
    await asyncio.gather(log.append("X/a", [sample("b", 0)]), log.append("X/a", [sample("b", 1)]),
                         log.append("X", [sample("a/b", 0)]))
    first, second = await log.load("X/a"), await log.load("X")
    assert (first.fingerprint, first.prompt_ids, first.n) == ("fp1", {"b"}, 2)
    assert sorted((s.prompt_id, s.sample_index) for s in first.samples) == [("b", 0), ("b", 1)]
    assert [(s.prompt_id, s.sample_index) for s in second.samples] == [("a/b", 0)]
    assert first.summary is None and (await log.load("X", samples=False)).samples == []
    assert await log.load("never") is None
    assert len(step_key("s" * 256)) < 64  # keys stay small whatever the id
    await log.shutdown()


@run_async
async def test_two_releases_sharing_one_redis_keep_their_step_logs_and_serving_records_apart(clean_redis):
    """Trainers of two releases both name a step "step-3": under one prefix the second
    release's re-submission met the first's fingerprint, and a restarted scheduler the
    other release's serving version."""
    a, b = StepLog(clean_redis, key_prefix="rl-a"), StepLog(clean_redis, key_prefix="rl-b")
    await a.open("step-3", "fp-a", ["p"], 2)
    await a.append("step-3", [sample("p", 0)])
    await a.save_serving(5, "aa" * 32, "")
    assert await b.load("step-3") is None and await b.load_serving() is None
    await b.open("step-3", "fp-b", ["q"], 1)
    assert (await a.load("step-3")).fingerprint == "fp-a" and (await b.load("step-3")).fingerprint == "fp-b"
    assert (await a.load_serving())[0] == 5
    assert step_key("step-3").startswith("rhymerl:step:{")  # the default keeps a deployment's keys across an upgrade
    # the shards of one release: each its own serving record (a push may reach one and not another)
    s0, s1 = StepLog(clean_redis, key_prefix="rl-a", shard_id="shard-0"), StepLog(clean_redis, key_prefix="rl-a",
                                                                                  shard_id="shard-1")
    await s0.save_serving(7, "bb" * 32, "")
    assert (await s0.load_serving())[0] == 7 and await s1.load_serving() is None
    assert (await a.load_serving())[0] == 5
    await s0.shutdown()
    await s1.shutdown()
    await a.shutdown()
    await b.shutdown()


@run_async
async def test_the_first_write_after_a_redis_restart_is_not_skipped():
    """A pooled connection from before the restart is dead: the write retries on a new
    one instead of skipping the log for ``retry_s`` while Redis is up."""
    from services.common.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    log = StepLog(server.url, retry_s=3600)
    try:
        await log.open("s", "fp", ["p"], 2)
        server.stop()
        server.start()  # same port, an empty Redis
        await log.open("s", "fp", ["p"], 2)
        await log.append("s", [sample("p", 1)])
        assert [s.sample_index for s in (await log.load("s")).samples] == [1]
    finally:
        await log.shutdown()
        server.stop()


@run_async
async def test_the_serving_record_has_no_ttl_and_a_sub_second_ttl_keeps_the_log(clean_redis):
    """The serving version's record lives until the next push, not step_log_ttl_s: it
    used to expire with the steps (24 h by default), after which a restarted scheduler
    could not catch a worker restarted on older weights up (tests/e2e/test_serving_record.py).
    A TTL under a second (allowed: gt=0) was truncated to EXPIRE 0, which deleted every
    step's log as it was written."""
    import redis.asyncio as aioredis

    log = StepLog(clean_redis, ttl_s=0.5)
    store = aioredis.Redis.from_url(clean_redis)
    try:
        await store.hset("rhymerl:serving", "version", "0")
        await store.expire("rhymerl:serving", 3600)  # as written by a release with the TTL
        assert await log.save_serving(3, "cc" * 32, "")
        assert await store.ttl("rhymerl:serving") == -1 and (await log.load_serving())[0] == 3
        await log.open("s", "fp", ["p"], 1)
        assert (await log.load("s")).fingerprint == "fp"
        assert 0 < await store.ttl(step_key("s")) <= 1
    finally:
        await store.aclose()
        await log.shutdown()
