"""The history service over real gRPC on loopback, backed by a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from rhymerl.v1 import history_pb2, history_pb2_grpc

from services.common.grpc_server import channel
from services.common.redis_server import EmbeddedRedis, free_port
from services.history.client import HistoryClient
from services.history.server import SERVICE_NAME, start_history
from services.history.settings import HistorySettings

REPO = Path(__file__).resolve().parents[2]


def run_async(test):
    """Runs an ``async def`` test on a fresh event loop (no pytest plugin needed)."""
    @functools.wraps(test)
    def wrapper(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return wrapper


@contextlib.asynccontextmanager
async def history_service(redis_url: str, **overrides):
    """Yields the address of an in-process history service on a free loopback port."""
    settings = HistorySettings(host="127.0.0.1", port=0, metrics_port=0, redis_url=redis_url, **overrides)
    _, port, cleanup = await start_history(settings)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await cleanup()


def counter(name: str) -> float:
    return REGISTRY.get_sample_value(f"rhymerl:{name}_total") or 0.0


@run_async
async def test_client_round_trip_over_grpc(clean_redis):
    """Breaks if the scheduler's and workers' view of history differs from what was written."""
    async with history_service(clean_redis, num_epochs=2) as address, HistoryClient(address) as client:
        step1 = [("p", "s1", i, 3, np.arange(i + 2, dtype=np.int32)) for i in (1, 0)]
        step1.append(("q", "s1", 0, 3, [5, 6, 7]))
        assert await client.put_rollouts(step1) == 3
        assert await client.put_rollouts(step1) == 0
        assert await client.put_rewards([("p", "s1", 1, 0.5)]) == 1
        for n in (2, 3):
            await client.put_rollouts([("p", f"s{n}", 0, n + 2, [n] * n)])

        history = await client.get_history(["q", "p", "new"])
        assert list(history) == ["q", "p", "new"]
        assert history["new"] == []
        [q_epoch] = history["q"]
        assert q_epoch.responses[0].tolist() == [5, 6, 7] and np.isnan(q_epoch.rewards).all()
        assert [(e.step_id, e.policy_version) for e in history["p"]] == [("s3", 5), ("s2", 4)]

        await client.put_rollouts([("r", "s1", i, 1, [1] * (i + 1)) for i in range(3)])
        await client.put_rewards([("r", "s1", 2, -1.0)])
        [epoch] = (await client.get_history(["r"], include_tokens=False))["r"]
        assert epoch.sample_indices.tolist() == [0, 1, 2] and epoch.lengths.tolist() == [1, 2, 3]
        np.testing.assert_array_equal(epoch.rewards, [np.nan, np.nan, -1.0])
        assert epoch.responses == []
        [epoch] = (await client.get_history(["r"], max_epochs=1))["r"]
        assert [r.tolist() for r in epoch.responses] == [[1], [1, 1], [1, 1, 1]]


@run_async
async def test_prompt_ids_with_braces_are_kept_apart_over_grpc(clean_redis):
    """Breaks if a prompt id holding '}' shares a key with another prompt's (keys.py escapes
    it): prompt "p}:epoch:s" step "1" once wrote the epoch of prompt "p" step "s}:epoch:1",
    and a prompt's epoch list could be another's epoch (WRONGTYPE: INTERNAL)."""
    pairs = [("p}:epoch:s", "1"), ("p", "s}:epoch:1"), ("p}:epoch:t", "1"), ("p", "t}:epochs"), ("{p}", "{1}")]
    async with history_service(clean_redis) as address, HistoryClient(address) as client:
        assert await client.put_rollouts([(p, s, 0, n, [n, n + 10]) for n, (p, s) in enumerate(pairs)]) == 5
        assert await client.put_rewards([(p, s, 0, float(n)) for n, (p, s) in enumerate(pairs)]) == 5
        history = await client.get_history(["p}:epoch:s", "p", "p}:epoch:t", "{p}"])
    got = {p: [(e.step_id, e.policy_version, [r.tolist() for r in e.responses], e.rewards.tolist()) for e in epochs]
           for p, epochs in history.items()}
    assert got == {"p}:epoch:s": [("1", 0, [[0, 10]], [0.0])],
                   "p": [("t}:epochs", 3, [[3, 13]], [3.0]), ("s}:epoch:1", 1, [[1, 11]], [1.0])],
                   "p}:epoch:t": [("1", 2, [[2, 12]], [2.0])],
                   "{p}": [("{1}", 4, [[4, 14]], [4.0])]}


@run_async
async def test_recent_responses_stream_the_newest_of_all_prompts(clean_redis):
    """Breaks if a worker's global draft index cannot learn other workers' responses at
    step start: the stream is newest first, across prompts, within both limits, and a
    re-sent batch is not streamed twice."""
    async with history_service(clean_redis) as address, HistoryClient(address) as client:
        assert await client.get_recent_responses(10, 100) == []
        await client.put_rollouts([("p", "s1", 0, 0, [1, 2, 3]), ("q", "s1", 1, 0, [4, 5])])
        await client.put_rollouts([("p", "s1", 0, 0, [1, 2, 3])])  # re-sent: not new
        await client.put_rollouts([("r", "s2", 2, 1, np.arange(6, dtype=np.int32))])
        recent = await client.get_recent_responses(10, 100)
        assert [(r.prompt_id, r.step_id, r.sample_index, r.token_ids.tolist()) for r in recent] == [
            ("r", "s2", 2, [0, 1, 2, 3, 4, 5]), ("q", "s1", 1, [4, 5]), ("p", "s1", 0, [1, 2, 3])]
        assert [r.prompt_id for r in await client.get_recent_responses(2, 100)] == ["r", "q"]
        assert [r.prompt_id for r in await client.get_recent_responses(10, 8)] == ["r", "q"]


@run_async
async def test_metrics_count_requests_hits_and_new_rollouts(clean_redis):
    """Breaks if the dashboards' history hit rate or write rate is wrong."""
    before = {name: counter(name) for name in ("history_prompts_looked_up", "history_prompts_hit",
                                               "history_rollouts_written")}
    requests_before = REGISTRY.get_sample_value("rhymerl:history_requests_total", {"method": "GetHistory"}) or 0
    async with history_service(clean_redis) as address, HistoryClient(address) as client:
        await client.put_rollouts([("p", "s1", i, 0, [1]) for i in range(3)])
        await client.put_rollouts([("p", "s1", i, 0, [1]) for i in range(4)])
        await client.get_history(["p", "q", "r"])
    assert counter("history_rollouts_written") - before["history_rollouts_written"] == 4
    assert counter("history_prompts_looked_up") - before["history_prompts_looked_up"] == 3
    assert counter("history_prompts_hit") - before["history_prompts_hit"] == 1
    assert REGISTRY.get_sample_value("rhymerl:history_requests_total", {"method": "GetHistory"}) == requests_before + 1


@pytest.mark.parametrize("method, request_, field", [
    ("PutRollouts", history_pb2.PutRolloutsRequest(rollouts=[
        history_pb2.Rollout(prompt_id="p", step_id="s", token_ids=[1]),
        history_pb2.Rollout(prompt_id="p", step_id="", token_ids=[1])]), "rollouts[1].step_id"),
    ("PutRollouts", history_pb2.PutRolloutsRequest(rollouts=[
        history_pb2.Rollout(prompt_id="p", step_id="s", sample_index=-2)]), "rollouts[0].sample_index"),
    ("PutRewards", history_pb2.PutRewardsRequest(rewards=[
        history_pb2.RolloutReward(step_id="s")]), "rewards[0].prompt_id"),
    ("GetHistory", history_pb2.GetHistoryRequest(prompt_ids=["p"], max_epochs=-1), "max_epochs"),
    ("GetHistory", history_pb2.GetHistoryRequest(prompt_ids=["p", ""]), "prompt_ids[1]"),
    ("PutRollouts", history_pb2.PutRolloutsRequest(rollouts=[
        history_pb2.Rollout(prompt_id="p", step_id="s" * 257, token_ids=[1])]), "rollouts[0].step_id"),
    ("PutRewards", history_pb2.PutRewardsRequest(rewards=[
        history_pb2.RolloutReward(prompt_id="p" * 300, step_id="s")]), "rewards[0].prompt_id"),
    ("PutRewards", history_pb2.PutRewardsRequest(rewards=[
        history_pb2.RolloutReward(prompt_id="p", step_id="s" * 100_000)]), "rewards[0].step_id"),
    ("GetHistory", history_pb2.GetHistoryRequest(prompt_ids=["p", "x" * 100_000]), "prompt_ids[1]"),
    ("GetHistory", history_pb2.GetHistoryRequest(prompt_ids=["p", "q", "p"]), "prompt_ids[2]"),
    ("GetRecentResponses", history_pb2.GetRecentResponsesRequest(max_responses=0, max_tokens=10), "max_responses"),
    ("GetRecentResponses", history_pb2.GetRecentResponsesRequest(max_responses=5, max_tokens=1 << 30),
     "max_tokens"),
])
@run_async
async def test_invalid_requests_get_invalid_argument_naming_the_field(clean_redis, method, request_, field):
    """Breaks if a caller's mistake comes back as INTERNAL or without the offending field."""
    async with history_service(clean_redis) as address, channel(address) as chan:
        stub = history_pb2_grpc.HistoryServiceStub(chan)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(stub, method)(request_, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(field + ": ")


async def expect_refused_and_nothing_written(redis_url: str, method: str, request_, field: str, caplog) -> str:
    """Calls ``method``; expects INVALID_ARGUMENT naming ``field`` first, no key written
    (neither an epoch nor the recent-responses stream) and no traceback logged."""
    import redis.asyncio as aioredis

    async with history_service(redis_url) as address, channel(address) as chan:
        stub = history_pb2_grpc.HistoryServiceStub(chan)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await getattr(stub, method)(request_, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field + ": "), err.value.details()
    client = aioredis.Redis.from_url(redis_url)
    try:
        assert await client.keys("*") == []
    finally:
        await client.aclose()
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    return err.value.details()


@run_async
async def test_an_out_of_range_token_id_is_refused_naming_it_and_nothing_is_written(clean_redis, caplog):
    """Breaks if PutRollouts stores a token id no worker's drafter takes (one such entry
    failed every step of its prompt, on every worker, for the history TTL) or half-writes
    the call: its clean rollouts of other prompts must not be stored either."""
    rollouts = [history_pb2.Rollout(prompt_id=f"clean{i}", step_id="old0", sample_index=0, token_ids=[1, 2, 3])
                for i in range(3)]
    rollouts.append(history_pb2.Rollout(prompt_id="poison1", step_id="old0", sample_index=0,
                                        token_ids=[28, 12, -5, 99999, 7]))
    details = await expect_refused_and_nothing_written(
        clean_redis, "PutRollouts", history_pb2.PutRolloutsRequest(rollouts=rollouts), "rollouts[3].token_ids[2]",
        caplog)
    assert "-5" in details and "[0, 2147483647]" in details


@run_async
async def test_a_100000_character_prompt_id_is_refused_naming_it_and_nothing_is_written(clean_redis, caplog):
    """Breaks if an id past the scheduler's 256-byte bound comes back INTERNAL (it overflowed
    the recent stream's uint16 length, after the epoch was already written)."""
    request_ = history_pb2.PutRolloutsRequest(rollouts=[
        history_pb2.Rollout(prompt_id="x" * 100_000, step_id="s", sample_index=0, token_ids=[1, 2])])
    details = await expect_refused_and_nothing_written(clean_redis, "PutRollouts", request_,
                                                       "rollouts[0].prompt_id", caplog)
    assert "at most 256 bytes" in details


@run_async
async def test_one_call_carries_at_most_max_per_prompt_rollouts_or_rewards_of_a_prompt(clean_redis, caplog):
    """Breaks if one call may hold a prompt's Lua script (and so all of Redis) for long:
    1.5 million rewards of one prompt in one call once blocked Redis ~1 minute, every
    other caller getting BUSY. A step's worth (MAX_PER_PROMPT) is still one call."""
    from services.history.store import MAX_PER_PROMPT

    over = [history_pb2.Rollout(prompt_id="p", step_id=f"s{i % 3}", sample_index=i, token_ids=[1])
            for i in range(MAX_PER_PROMPT + 1)]
    await expect_refused_and_nothing_written(clean_redis, "PutRollouts", history_pb2.PutRolloutsRequest(rollouts=over),
                                             f"rollouts[{MAX_PER_PROMPT}].prompt_id", caplog)
    rewards = [history_pb2.RolloutReward(prompt_id="p", step_id="s", sample_index=i) for i in range(MAX_PER_PROMPT + 1)]
    await expect_refused_and_nothing_written(clean_redis, "PutRewards", history_pb2.PutRewardsRequest(rewards=rewards),
                                             f"rewards[{MAX_PER_PROMPT}].prompt_id", caplog)
    async with history_service(clean_redis) as address, HistoryClient(address) as client:
        step = [("p", "s", i, 0, [i]) for i in range(MAX_PER_PROMPT)] + [("q", "s", 0, 0, [1])]
        assert await client.put_rollouts(step) == MAX_PER_PROMPT + 1


@run_async
async def test_health_reports_serving(clean_redis):
    """Breaks if Kubernetes probes or the scheduler's readiness wait never see the service up."""
    async with history_service(clean_redis) as address, channel(address) as chan:
        health = health_pb2_grpc.HealthStub(chan)
        for service in ("", SERVICE_NAME):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert SERVICE_NAME == "rhymerl.v1.HistoryService"


@run_async
async def test_dead_redis_gives_unavailable_quickly():
    """Breaks if a Redis outage hangs the scheduler's calls instead of failing them."""
    with EmbeddedRedis() as redis_server:
        async with history_service(redis_server.url, redis_timeout_s=1.0) as address, HistoryClient(address) as client:
            await client.put_rollouts([("p", "s1", 0, 0, [1])])
            redis_server.stop()
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.get_history(["p"])
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "unreachable" in err.value.details()
            assert time.monotonic() - start < 30  # a hang guard: a stopped Redis refuses at once


@run_async
async def test_a_history_started_before_its_redis_waits_for_it_then_serves():
    """Started beside its Redis (compose, the chart's bundled one, a node restarting both):
    it waited for nothing and exited, into a crash loop, until Redis was up."""
    port = free_port()
    redis_server = EmbeddedRedis(port=port)

    async def redis_later():
        await asyncio.sleep(1.5)
        await asyncio.to_thread(redis_server.start)

    later = asyncio.create_task(redis_later())
    try:
        async with history_service(f"redis://127.0.0.1:{port}/0", redis_timeout_s=1.0,
                                   redis_start_wait_s=120) as address, HistoryClient(address) as client:
            assert later.done()  # it served only once Redis answered
            await client.put_rollouts([("p", "s1", 0, 0, [1, 2])])
            assert len((await client.get_history(["p"]))["p"]) == 1
    finally:
        await later
        redis_server.stop()


@run_async
async def test_a_redis_that_never_answers_ends_the_start_naming_the_setting():
    from services.common.errors import SettingError

    started = time.monotonic()
    with pytest.raises(SettingError) as err:
        async with history_service(f"redis://127.0.0.1:{free_port()}/0", redis_timeout_s=1.0,
                                   redis_start_wait_s=1.0):
            pass
    assert err.value.setting == "redis_url" and "did not answer within 1 s" in str(err.value)
    assert time.monotonic() - started < 60  # a hang guard: the wait is bounded


@run_async
async def test_readiness_follows_redis():
    """Breaks if the history service says SERVING while its Redis is down (every call
    would fail), or stays NOT_SERVING after Redis is back."""
    async def status(health) -> int:
        reply = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
        return reply.status

    async def wait_for(health, wanted: int) -> None:
        deadline = time.monotonic() + 60  # a hang guard, not a speed assertion
        while await status(health) != wanted:
            assert time.monotonic() < deadline, f"readiness never became {wanted}"
            await asyncio.sleep(0.05)

    redis_server = EmbeddedRedis().start()
    try:
        async with history_service(redis_server.url, redis_timeout_s=1.0) as address, channel(address) as chan:
            health = health_pb2_grpc.HealthStub(chan)
            assert await status(health) == health_pb2.HealthCheckResponse.SERVING
            redis_server.stop()
            await wait_for(health, health_pb2.HealthCheckResponse.NOT_SERVING)
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING  # alive: no restart would help
            redis_server.start()
            await wait_for(health, health_pb2.HealthCheckResponse.SERVING)
    finally:
        redis_server.stop()


def tcp_listen_ports(pid: int) -> set[int]:
    """The TCP ports process ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_tcp_embedded_redis_listens_on_its_port():
    """Breaks if tcp_listen_ports cannot see a listening port (the check above would pass vacuously)."""
    with EmbeddedRedis() as server:
        assert tcp_listen_ports(server._proc.pid) == {server.port}


def redis_children() -> set[int]:
    """Pids of redis-server processes whose parent is this test process."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().split()
            if fields[1] == "(redis-server)" and int(fields[3]) == os.getpid():
                pids.add(int(fields[0]))
    return pids


@run_async
async def test_empty_redis_url_starts_and_stops_a_private_redis():
    """Breaks if `rhymerl history` without a Redis URL does not work, or leaks a redis-server."""
    before = redis_children()
    async with history_service("") as address, HistoryClient(address) as client:
        (private,) = redis_children() - before
        # on no TCP port: a port picked here could be one a parent gave a later process
        assert tcp_listen_ports(private) == set()
        assert await client.put_rollouts([("p", "s1", 0, 0, [1, 2])]) == 1
        assert [e.lengths.tolist() for e in (await client.get_history(["p"]))["p"]] == [[2]]
    assert redis_children() == before


def test_server_process_serves_until_sigterm(redis_url):
    """Breaks if `python -m services.history.server` does not come up, export metrics, or stop cleanly."""
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "RHYMERL_HISTORY_HOST": "127.0.0.1", "RHYMERL_HISTORY_PORT": str(port),
           "RHYMERL_HISTORY_METRICS_PORT": str(metrics_port), "RHYMERL_HISTORY_REDIS_URL": redis_url}
    proc = subprocess.Popen([sys.executable, "-m", "services.history.server"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as chan:
            reply = health_pb2_grpc.HealthStub(chan).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), wait_for_ready=True, timeout=20)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
            assert b"rhymerl:history_prompts_looked_up_total" in response.read()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, proc.stdout.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
