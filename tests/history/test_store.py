"""HistoryStore against a real redis-server (the ``clean_redis`` fixture)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from urllib.parse import unquote

import numpy as np
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio.connection import Connection
from redis.crc import key_slot

from services.common.errors import InvalidArgument, Unavailable
from services.common.redis_server import EmbeddedRedis, free_port
from services.history.keys import HistoryKeys, escape_id
from services.history.records import Reward, Rollout
from services.history.store import HistoryStore

TTL = 3600


def run_async(test):
    """Runs an ``async def`` test on a fresh event loop (no pytest plugin needed)."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return wrapper


@contextlib.asynccontextmanager
async def open_store(url: str, num_epochs: int = 4, **client_kwargs):
    client = aioredis.Redis.from_url(url, **client_kwargs)
    store = HistoryStore(client, HistoryKeys(ttl_seconds=TTL), num_epochs)
    try:
        yield store
    finally:
        await store.close()


def tokens(prompt: str, step: str, sample_index: int, length: int) -> np.ndarray:
    """Distinct, reproducible token ids for one sample."""
    seed = abs(hash((prompt, step, sample_index))) % 2**32
    return np.random.default_rng(seed).integers(0, 2**31 - 1, size=length, dtype=np.int32, endpoint=True)


async def all_keys(store: HistoryStore) -> list[str]:
    return sorted(k.decode() for k in await store.client.keys("*"))


@run_async
async def test_round_trip_keeps_tokens_lengths_rewards_and_version(clean_redis):
    """Breaks if packing, sample ordering or the NaN-for-missing-reward rule is wrong."""
    async with open_store(clean_redis) as store:
        written = [Rollout("p", "s1", i, 7, tokens("p", "s1", i, 5 + 3 * i)) for i in (3, 0, 2, 1)]
        written.append(Rollout("q", "s1", 0, 7, []))
        assert await store.put_rollouts(written) == 5
        assert await store.put_rewards([Reward("p", "s1", 2, 0.25), Reward("p", "s1", 0, -1.0)]) == 2

        [p_epochs, q_epochs] = await store.get_history(["p", "q"])
        [epoch] = p_epochs
        assert (epoch.step_id, epoch.policy_version) == ("s1", 7)
        assert epoch.sample_indices.tolist() == [0, 1, 2, 3]
        assert epoch.lengths.tolist() == [5, 8, 11, 14]
        for i, response in enumerate(epoch.responses):
            np.testing.assert_array_equal(response, tokens("p", "s1", i, 5 + 3 * i))
        np.testing.assert_array_equal(epoch.rewards, np.array([-1.0, np.nan, 0.25, np.nan], np.float32))
        [q_epoch] = q_epochs
        assert q_epoch.lengths.tolist() == [0] and q_epoch.responses[0].size == 0
        assert np.isnan(q_epoch.rewards).all()


@run_async
async def test_resent_rollouts_are_neither_duplicated_nor_counted(clean_redis):
    """Breaks if a retried PutRollouts adds samples twice or inflates num_written."""
    async with open_store(clean_redis) as store:
        batch = [Rollout("p", "s1", i, 1, tokens("p", "s1", i, 4)) for i in range(3)]
        assert await store.put_rollouts(batch + batch[:1]) == 3  # duplicates inside one batch too
        assert await store.put_rollouts(batch) == 0
        # A re-send with other tokens keeps the first copy.
        assert await store.put_rollouts([Rollout("p", "s1", 1, 1, [9, 9])]) == 0
        assert await store.put_rollouts([Rollout("p", "s1", 3, 1, [9, 9])]) == 1

        [[epoch]] = await store.get_history(["p"])
        assert epoch.sample_indices.tolist() == [0, 1, 2, 3]
        assert epoch.lengths.tolist() == [4, 4, 4, 2]
        np.testing.assert_array_equal(epoch.responses[1], tokens("p", "s1", 1, 4))
        assert await store.put_rewards([Reward("p", "s1", 1, 1.0)]) == 1
        assert await store.put_rewards([Reward("p", "s1", 1, 0.5)]) == 0  # last value wins, not counted
        [[epoch]] = await store.get_history(["p"])
        assert epoch.rewards[1] == 0.5


@run_async
async def test_epochs_beyond_k_are_evicted_and_read_newest_first(clean_redis):
    """Breaks if old epochs leak (memory grows) or epochs come back in the wrong order."""
    async with open_store(clean_redis, num_epochs=3) as store:
        for n in range(1, 6):
            await store.put_rollouts([Rollout("p", f"s{n}", 0, n, [n])])
        # A late sample of a kept epoch neither reorders nor evicts anything.
        await store.put_rollouts([Rollout("p", "s3", 1, 3, [3, 3])])

        [epochs] = await store.get_history(["p"])
        assert [e.step_id for e in epochs] == ["s5", "s4", "s3"]
        assert [e.policy_version for e in epochs] == [5, 4, 3]
        assert epochs[2].sample_indices.tolist() == [0, 1]
        [newest_two] = await store.get_history(["p"], max_epochs=2)
        assert [e.step_id for e in newest_two] == ["s5", "s4"]
        assert await all_keys(store) == [
            "rhymerl:{p}:epoch:s3", "rhymerl:{p}:epoch:s4", "rhymerl:{p}:epoch:s5", "rhymerl:{p}:epochs"]


@run_async
async def test_every_key_gets_the_ttl_and_writes_refresh_it(clean_redis):
    """Breaks if any key could live forever, or an active prompt's history expires."""
    async with open_store(clean_redis) as store:
        await store.put_rollouts([Rollout(p, s, 0, 1, [1, 2]) for p in ("p", "q") for s in ("s1", "s2")])
        await store.put_rewards([Reward("p", "s1", 0, 1.0), Reward("r", "s9", 0, 1.0)])  # r: reward first
        keys = await all_keys(store)
        assert len(keys) == 7
        for key in keys:
            assert 0 < await store.client.ttl(key) <= TTL, key

        for key in keys:
            await store.client.expire(key, 5)
        await store.put_rollouts([Rollout("p", "s2", 1, 1, [1])])
        for key in keys:
            expected_refreshed = key.startswith("rhymerl:{p}")
            assert (await store.client.ttl(key) > 5) == expected_refreshed, key


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: between the first '{' and the next '}'."""
    start = key.index("{")
    return key[start + 1:key.index("}", start + 1)]


# Ids that end the hash tag early, open a second one, leave it empty, or look escaped already.
BRACED_IDS = ("a}b", "x{y", "}p", "{}", "}", "{", "p}:epoch:s", "%7D", "%", "{p}}{")


@run_async
async def test_all_keys_of_a_prompt_share_one_hash_slot(clean_redis):
    """Breaks if a prompt's keys could land on different Cluster slots (the Lua scripts need
    one: CROSSSLOT), e.g. a prompt id starting with '}' made the tag empty, so Redis hashed
    each whole key; step ids with braces must not move an epoch to another slot either."""
    async with open_store(clean_redis, num_epochs=2) as store:
        seen: set[str] = set()
        for prompt in ("p", "prompt:with:colons", "h3a9f", *BRACED_IDS):
            for n in range(3):
                await store.put_rollouts([Rollout(prompt, f"step:{n}" + "}{" * (n % 2), 0, n, [1])])
            await store.put_rewards([Reward(prompt, "step:2", 0, 1.0)])
            new_keys = set(await all_keys(store)) - seen
            seen |= new_keys
            assert len(new_keys) == 3  # the epoch list and K=2 epochs
            assert {hash_tag(k) for k in new_keys} == {escape_id(prompt)}, new_keys
            assert len({key_slot(k.encode()) for k in new_keys}) == 1, new_keys
            assert {key_slot(k.encode()) for k in new_keys} == {key_slot(escape_id(prompt).encode())}
            [epochs] = await store.get_history([prompt])
            assert [e.step_id for e in epochs] == ["step:2", "step:1}{"]


def test_an_id_without_braces_or_percent_keeps_its_keys():
    """Breaks if keys of ordinary ids change: a store written before would look empty."""
    keys = HistoryKeys()
    assert keys.epochs("p") == "rhymerl:{p}:epochs"
    assert keys.epoch("prompt:7 é", "step-3") == "rhymerl:{prompt:7 é}:epoch:step-3"
    assert keys.epoch_stem("a/b") == "rhymerl:{a/b}:epoch:"
    assert HistoryKeys(prefix="x:y").epochs("7") == "x:y:{7}:epochs"
    assert keys.recent() == "rhymerl:recent"
    # braces and the escape character are percent-escaped, nothing else; the step id is kept as it is
    assert keys.epochs("a}b") == "rhymerl:{a%7Db}:epochs"
    assert keys.epoch("{%}", "s}{") == "rhymerl:{%7B%25%7D}:epoch:s}{"


@settings(max_examples=200, deadline=None)
@given(prompt_id=st.text(alphabet=st.sampled_from("%{}7BDd25ab:"), max_size=12) | st.text(max_size=12))
def test_the_escaped_id_is_brace_free_and_reversible(prompt_id):
    """Breaks if two prompt ids could share a tag (escaping not one-to-one) or a tag could
    hold a brace."""
    escaped = escape_id(prompt_id)
    assert "{" not in escaped and "}" not in escaped
    assert unquote(escaped) == prompt_id
    if not set(prompt_id) & set("%{}"):
        assert escaped == prompt_id


@run_async
async def test_prompts_whose_keys_once_collided_are_stored_apart(clean_redis):
    """Breaks if one prompt's key can equal another's: prompt "p}:epoch:s" step "1" had the
    epoch key of prompt "p" step "s}:epoch:1" (the first write won, the other prompt read
    back its tokens), and prompt "p}:epoch:t" had as epoch list the epoch hash of prompt "p"
    step "t}:epochs" (WRONGTYPE)."""
    pairs = [("p}:epoch:s", "1"), ("p", "s}:epoch:1"), ("p}:epoch:t", "1"), ("p", "t}:epochs")]
    async with open_store(clean_redis) as store:
        assert await store.put_rollouts([Rollout(p, s, 0, n, [n, n + 10]) for n, (p, s) in enumerate(pairs)]) == 4
        assert await store.put_rewards([Reward(p, s, 0, float(n)) for n, (p, s) in enumerate(pairs)]) == 4
        assert len(set(await all_keys(store))) == 3 + 4  # an epoch list per prompt, an epoch per pair
        histories = await store.get_history(["p}:epoch:s", "p", "p}:epoch:t"])
    got = [[(e.step_id, e.policy_version, [r.tolist() for r in e.responses], e.rewards.tolist()) for e in epochs]
           for epochs in histories]
    assert got == [[("1", 0, [[0, 10]], [0.0])],
                   [("t}:epochs", 3, [[3, 13]], [3.0]), ("s}:epoch:1", 1, [[1, 11]], [1.0])],
                   [("1", 2, [[2, 12]], [2.0])]]


def summary(histories) -> list:
    return [[(e.step_id, e.sample_indices.tolist(), e.lengths.tolist(), [r.tolist() for r in e.responses])
             for e in epochs] for epochs in histories]


class CountingConnection(Connection):
    """Counts writes to the socket: one per round trip (a pipeline is sent in one write)."""

    num_sends = 0

    async def send_packed_command(self, command, check_health=True):
        CountingConnection.num_sends += 1
        return await super().send_packed_command(command, check_health)


@run_async
async def test_a_whole_step_is_written_and_read_in_one_round_trip(clean_redis):
    """Breaks if a step's history costs a round trip per prompt (latency x prompts)."""
    async with open_store(clean_redis, connection_class=CountingConnection) as store:
        step = [Rollout(f"p{k}", "s1", i, 1, [k, i]) for k in range(50) for i in range(4)]
        prompt_ids = [f"p{k}" for k in range(60)]
        await store.put_rollouts(step[:1])  # loads the scripts and opens the connection
        await store.get_history(["p0"])

        CountingConnection.num_sends = 0
        assert await store.put_rollouts(step) == len(step) - 1
        assert CountingConnection.num_sends == 1
        CountingConnection.num_sends = 0
        histories = await store.get_history(prompt_ids)
        assert CountingConnection.num_sends == 1
        assert sum(1 for h in histories if h) == 50

        await store.client.script_flush()  # as after a Redis restart: reload, then retry once
        CountingConnection.num_sends = 0
        assert summary(await store.get_history(prompt_ids)) == summary(histories)
        assert CountingConnection.num_sends == 3


@run_async
async def test_a_step_larger_than_a_pipeline_goes_in_round_trips_of_pipeline_calls(clean_redis, monkeypatch):
    """A whole step's prompts (up to a quarter million) went in one pipeline, written and
    read back past the socket's timeout (a million ids: UNAVAILABLE): PIPELINE_CALLS
    script calls to a round trip, the replies in the request's order, a script reload
    after a restart retrying only the calls that missed it."""
    from services.history import store as store_module

    monkeypatch.setattr(store_module, "PIPELINE_CALLS", 16)
    async with open_store(clean_redis, connection_class=CountingConnection) as store:
        step = [Rollout(f"p{k}", "s1", i, 1, [k, i]) for k in range(50) for i in range(2)]
        prompt_ids = [f"p{k}" for k in range(60)][::-1]
        await store.put_rollouts(step[:1])  # loads the scripts and opens the connection
        await store.get_history(["p0"])
        CountingConnection.num_sends = 0
        assert await store.put_rollouts(step) == len(step) - 1
        assert CountingConnection.num_sends == 4  # 50 prompts: 16 + 16 + 16 + 2
        CountingConnection.num_sends = 0
        histories = await store.get_history(prompt_ids)
        assert CountingConnection.num_sends == 4
        assert [[[r.tolist() for r in e.responses] for e in h] for h in histories[10:]] == [
            [[[k, 0], [k, 1]]] for k in range(49, -1, -1)]
        assert not any(histories[:10])
        await store.client.script_flush()
        assert summary(await store.get_history(prompt_ids)) == summary(histories)


@run_async
async def test_lengths_only_read_sends_no_tokens(clean_redis):
    """Breaks if length prediction pays for transferring every stored token."""
    async with open_store(clean_redis) as store:
        await store.put_rollouts([Rollout(p, "s1", i, 1, tokens(p, "s1", i, 10_000))
                                  for p in ("p", "q") for i in range(4)])

        async def bytes_sent_by_redis(read) -> int:
            before = (await store.client.info("stats"))["total_net_output_bytes"]
            result = await read
            after = (await store.client.info("stats"))["total_net_output_bytes"]
            return after - before, result

        sent_with_tokens, _ = await bytes_sent_by_redis(store.get_history(["p", "q"]))
        sent_lengths_only, histories = await bytes_sent_by_redis(store.get_history(["p", "q"], include_tokens=False))
        assert sent_with_tokens > 8 * 40_000
        assert sent_lengths_only < 8_000  # a few hundred bytes of reply plus the INFO reply
        for [epoch] in histories:
            assert epoch.lengths.tolist() == [10_000] * 4 and epoch.responses == []


@run_async
async def test_an_epoch_with_thousands_of_samples_reads_back_whole(clean_redis):
    """Breaks if the read script's field lists overflow Lua's stack (it reads them in chunks)."""
    async with open_store(clean_redis) as store:
        num_samples = 2500
        assert await store.put_rollouts([Rollout("p", "s1", i, 0, [i]) for i in range(num_samples)]) == num_samples
        await store.put_rewards([Reward("p", "s1", num_samples - 1, 1.0)])
        [[epoch]] = await store.get_history(["p"])
        assert epoch.sample_indices.tolist() == list(range(num_samples))
        assert [int(r[0]) for r in epoch.responses] == list(range(num_samples))
        assert epoch.rewards[-1] == 1.0 and np.isnan(epoch.rewards[:-1]).all()


@run_async
async def test_unknown_prompts_and_empty_requests_have_empty_history(clean_redis):
    """Breaks if a first-epoch prompt errors instead of reading as 'no history'."""
    async with open_store(clean_redis) as store:
        assert await store.get_history([]) == []
        assert await store.get_history(["never", "seen"]) == [[], []]
        assert await store.put_rollouts([]) == 0 and await store.put_rewards([]) == 0


@run_async
async def test_a_reward_sent_before_its_rollout_is_kept(clean_redis):
    """Breaks if rewards racing ahead of the scheduler's history write are lost."""
    async with open_store(clean_redis) as store:
        assert await store.put_rewards([Reward("p", "s1", 1, 2.0)]) == 1
        assert await store.get_history(["p"]) == [[]]
        await store.put_rollouts([Rollout("p", "s1", i, 1, [i]) for i in range(2)])
        [[epoch]] = await store.get_history(["p"])
        np.testing.assert_array_equal(epoch.rewards, [np.nan, 2.0])


@pytest.mark.parametrize("call, field", [
    (lambda s: s.put_rollouts([Rollout("p", "s", 0, 0, [1]), Rollout("", "s", 0, 0, [1])]), "rollouts[1].prompt_id"),
    (lambda s: s.put_rollouts([Rollout("p", "", 0, 0, [1])]), "rollouts[0].step_id"),
    (lambda s: s.put_rollouts([Rollout("p", "s", -1, 0, [1])]), "rollouts[0].sample_index"),
    (lambda s: s.put_rewards([Reward("p", "s", 0, 1.0)] * 3 + [Reward("p", "", 0, 1.0)]), "rewards[3].step_id"),
    (lambda s: s.get_history(["p"], max_epochs=-1), "max_epochs"),
    (lambda s: s.get_history(["p", "q", ""]), "prompt_ids[2]"),
    # every size a client controls is bounded (ids: the scheduler's 256 bytes, counted in UTF-8)
    (lambda s: s.put_rollouts([Rollout("p", "s", 0, 0, [1]), Rollout("é" * 129, "s", 0, 0, [1])]),
     "rollouts[1].prompt_id"),
    (lambda s: s.put_rollouts([Rollout("p", "s" * 257, 0, 0, [1])]), "rollouts[0].step_id"),
    (lambda s: s.put_rollouts([Rollout("p", "s", 2**31, 0, [1])]), "rollouts[0].sample_index"),
    (lambda s: s.put_rewards([Reward("p" * 100_000, "s", 0, 1.0)]), "rewards[0].prompt_id"),
    (lambda s: s.get_history(["p", "q" * 257]), "prompt_ids[1]"),
    (lambda s: s.get_history(["p", "q", "p"]), "prompt_ids[2]"),
    # token ids: int32s >= 0, named by position, whatever sequence type brings them
    (lambda s: s.put_rollouts([Rollout("q", "s", 0, 0, [1])] * 2 + [Rollout("p", "s", 0, 0, [4, 5, -1])]),
     "rollouts[2].token_ids[2]"),
    (lambda s: s.put_rollouts([Rollout("p", "s", 0, 0, np.array([7, -2**31], dtype=np.int32))]),
     "rollouts[0].token_ids[1]"),
    (lambda s: s.put_rollouts([Rollout("p", "s", 0, 0, [0, 2**31])]), "rollouts[0].token_ids[1]"),
    (lambda s: s.put_rollouts([Rollout("p", "s", 0, 0, [1, 2**80])]), "rollouts[0].token_ids"),
    (lambda s: s.put_rollouts([Rollout("p", "s", 0, 0, ["a"])]), "rollouts[0].token_ids"),
    (lambda s: s.put_rollouts([Rollout("p", "s", 0, 0, [1]), Rollout("q", "s", 0, 0, np.zeros(2**21 + 1, np.int32))]),
     "rollouts[1].token_ids"),
])
@run_async
async def test_invalid_arguments_name_the_field_and_write_nothing(clean_redis, call, field):
    """Breaks if a bad request is half-applied or its error does not say which field is wrong."""
    async with open_store(clean_redis) as store:
        with pytest.raises(InvalidArgument) as err:
            await call(store)
        assert err.value.field == field and str(err.value).startswith(field + ": ")
        assert await all_keys(store) == []


@run_async
async def test_the_largest_allowed_fields_are_stored(clean_redis):
    """Breaks if the bounds refuse what the scheduler sends: 256-byte ids, token ids up to
    2^31 - 1, sample indices up to 2^31 - 1, empty responses."""
    prompt, step = "p" * 256, "é" * 128
    async with open_store(clean_redis) as store:
        rollouts = [Rollout(prompt, step, 2**31 - 1, 0, [0, 2**31 - 1]), Rollout(prompt, step, 0, 0, [])]
        assert await store.put_rollouts(rollouts) == 2
        assert await store.put_rewards([Reward(prompt, step, 2**31 - 1, 1.0)]) == 1
        [[epoch]] = await store.get_history([prompt])
        assert epoch.step_id == step and epoch.sample_indices.tolist() == [0, 2**31 - 1]
        assert [r.tolist() for r in epoch.responses] == [[], [0, 2**31 - 1]]


def test_the_id_bound_is_the_schedulers():
    """Breaks if the two bounds drift apart: a step the scheduler accepts would then lose
    its history writes (or the store would accept ids the scheduler never sends)."""
    from services.history import store
    from services.scheduler import intake

    assert store.check_id is intake.check_id  # one check, one bound (services/common/validation.py)


@run_async
async def test_a_redis_busy_with_a_script_gives_unavailable():
    """Breaks if Redis answering BUSY (a script still running past its time limit) comes
    back as an internal error with a traceback instead of a retryable UNAVAILABLE."""
    with EmbeddedRedis() as server:
        async with open_store(server.url) as store:
            await store.client.config_set("lua-time-limit", 50)
            other = aioredis.Redis.from_url(server.url)
            spin = "local t = redis.call('TIME') repeat local n = redis.call('TIME') until n[1] - t[1] >= 2"
            busy = asyncio.create_task(other.eval(spin, 0))
            try:
                await asyncio.sleep(0.5)  # past the time limit: Redis answers others BUSY
                with pytest.raises(Unavailable, match="busy"):
                    await store.get_history(["p"])
            finally:
                await busy
                await other.aclose()


@run_async
async def test_unreachable_redis_fails_fast_with_unavailable():
    """Breaks if a dead Redis hangs the scheduler instead of failing the call."""
    store = HistoryStore.from_url(f"redis://127.0.0.1:{free_port()}/0", HistoryKeys(), 4, timeout_s=1.0)
    start = time.monotonic()
    for call in (store.ping(), store.get_history(["p"]), store.put_rollouts([Rollout("p", "s", 0, 0, [1])])):
        with pytest.raises(Unavailable, match="unreachable"):
            await call
    assert time.monotonic() - start < 30  # a hang guard, not a speed check: refused connections fail at once
    await store.close()


@run_async
async def test_a_redis_that_stops_answering_fails_the_call_within_the_timeout():
    """Breaks if a stalled Redis (accepting but not answering) hangs a call forever."""
    with EmbeddedRedis() as server:
        store = HistoryStore.from_url(server.url, HistoryKeys(), 4, timeout_s=0.3)
        await store.ping()
        await store.client.execute_command("CLIENT", "PAUSE", 120_000, "ALL")
        start = time.monotonic()
        with pytest.raises(Unavailable, match="unreachable"):
            await store.get_history(["p"])
        # Without the timeout the call would wait out the 120 s pause; the margin is for a busy machine.
        assert time.monotonic() - start < 60
        await store.close()


# --- against a brute-force reference ------------------------------------------------

operations = st.lists(st.tuples(
    st.sampled_from(["p", "q"]),  # prompt
    st.integers(0, 5),  # step
    st.integers(0, 2),  # sample index
    st.integers(0, 4),  # length
), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(operations, min_size=1, max_size=4))
def test_store_matches_a_reference_model(clean_redis, batches):
    """Breaks if any interleaving of batches, re-sends and evictions diverges from the rules:
    first write of a sample wins, epochs ordered by first arrival, only the newest K kept."""
    num_epochs = 2
    reference: dict[str, dict[str, dict[int, int]]] = {}  # prompt -> step -> sample -> length (arrival order)

    async def body():
        async with open_store(clean_redis, num_epochs=num_epochs) as store:
            await store.client.flushall()
            for batch in batches:
                num_new = 0
                for prompt in dict.fromkeys(p for p, *_ in batch):  # a batch is applied prompt by prompt
                    steps = reference.setdefault(prompt, {})
                    for step, i, length in [(s, i, n) for p, s, i, n in batch if p == prompt]:
                        samples = steps.setdefault(f"s{step}", {})
                        if i not in samples:
                            samples[i] = length
                            num_new += 1
                    for old in list(steps)[:-num_epochs]:
                        del steps[old]
                rollouts = [Rollout(p, f"s{s}", i, s, np.arange(n)) for p, s, i, n in batch]
                assert await store.put_rollouts(rollouts) == num_new
            for prompt, epochs in zip(["p", "q"], await store.get_history(["p", "q"], include_tokens=False)):
                kept = reference.get(prompt, {})
                expected = [(step, sorted(samples.items())) for step, samples in reversed(kept.items())]
                got = [(e.step_id, list(zip(e.sample_indices.tolist(), e.lengths.tolist()))) for e in epochs]
                assert got == expected
                assert all(math.isnan(r) for e in epochs for r in e.rewards)

    asyncio.run(body())
