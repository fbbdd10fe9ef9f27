"""The step router against scripted shards: real gRPC servers on loopback that answer
RolloutService as a scheduler does (each sample's seed derived as the scheduler derives
it, its tokens a function of the seed), but fail, hold or leave when a test says so.
Every wait is on state; the hang guard only bounds a broken router."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib

import grpc
import pytest
from rhymerl.types import event_samples
from rhymerl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from services.common.errors import ResourceExhausted
from services.common.ids import sample_seed
from services.router import core as router_core
from services.router.core import Router, duplicates_dropped, shards_caught_up, step_seed_of
from services.router.registry import ShardAnnouncer, ShardDirectory, ShardInfo
from services.router.server import RouterServicer
from tests.aio import run_async

LENGTH = common_pb2.FINISH_REASON_LENGTH


class ScriptedShard(rollout_pb2_grpc.RolloutServiceServicer):
    """A shard that runs sub-steps instantly, unless held; ``fail_after`` samples into its
    next sub-step it ends the call UNAVAILABLE (as a killed scheduler's stream ends);
    ``batched``: each prompt's samples sent in one SampleBatch event, as a scheduler
    sends the samples it has ready."""

    def __init__(self, name: str, fail_after: int | None = None, held: bool = False, batched: bool = False):
        self.name, self.fail_after, self.batched = name, fail_after, batched
        self.release = asyncio.Event()
        if not held:
            self.release.set()
        self.version = 0
        self.sub_steps: list[rollout_pb2.SubmitStepRequest] = []
        self.delivered: list[tuple[str, int]] = []
        self.rewards: list[rollout_pb2.ReportRewardsRequest] = []
        self.logprobs_reports: list[rollout_pb2.ReportLogprobsRequest] = []
        self.cancelled: set[str] = set()

    async def SubmitStep(self, request, context):
        self.sub_steps.append(request)
        step_seed = request.sampling.seed if request.sampling.HasField("seed") else None
        for prompt in request.prompts:
            batch = []
            for k in range(request.n):
                await self.release.wait()
                if request.step_id in self.cancelled:  # as a scheduler ends a cancelled step's samples
                    yield rollout_pb2.StepEvent(sample=rollout_pb2.SampleResult(
                        step_id=request.step_id, prompt_id=prompt.prompt_id, sample_index=k,
                        finish_reason=common_pb2.FINISH_REASON_ABORT))
                    continue
                if self.fail_after is not None and len(self.delivered) >= self.fail_after:
                    self.fail_after = None
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "shard going down")
                seed = sample_seed(step_seed, request.step_id, prompt.prompt_id, k)
                self.delivered.append((prompt.prompt_id, k))
                batch.append(rollout_pb2.SampleResult(
                    step_id=request.step_id, prompt_id=prompt.prompt_id, sample_index=k, token_ids=[seed % 997, 1],
                    logprobs=[-0.5, -0.25] if request.sampling.logprobs else [],
                    seed=seed, finish_reason=LENGTH, policy_version=self.version))
                if not self.batched:
                    yield rollout_pb2.StepEvent(sample=batch.pop())
            if batch:
                yield rollout_pb2.StepEvent(samples=rollout_pb2.SampleBatch(samples=batch))
        yield rollout_pb2.StepEvent(summary=rollout_pb2.StepSummary(step_id=request.step_id, policy="fake"))

    async def CancelStep(self, request, context):
        self.cancelled.add(request.step_id)
        running = sum(len(r.prompts) * r.n for r in self.sub_steps if r.step_id == request.step_id)
        self.release.set()
        return rollout_pb2.CancelStepResponse(num_cancelled=running)

    refuse_updates = False  # as a scheduler without a usable worker answers a push
    pushed = b""

    async def PushWeights(self, request_iterator, context):
        chunks = [c async for c in request_iterator]
        if self.refuse_updates:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no rollout worker is registered and healthy")
        self.version, self.pushed = chunks[0].header.version, b"".join(c.data for c in chunks[1:])
        return common_pb2.WeightUpdateResponse(version=self.version, num_workers_updated=1)

    async def GetStats(self, request, context):
        return rollout_pb2.ServiceStats(policy_version=self.version, num_generated_tokens=2 * len(self.delivered))

    async def ReportRewards(self, request, context):
        self.rewards.append(request)
        return rollout_pb2.ReportRewardsResponse(num_recorded=len(request.rewards))

    async def ReportLogprobs(self, request, context):
        self.logprobs_reports.append(request)
        n = len(request.samples)
        return rollout_pb2.ReportLogprobsResponse(step=rollout_pb2.MismatchStats(num_samples=n, num_tokens=2 * n))


class Fleet:
    """Scripted shards served on loopback, and a router that knows them (capacity 4 each:
    a window of two groups of n=2)."""

    def __init__(self, *shards: ScriptedShard, capacity: int = 4):
        self.shards, self.capacity = list(shards), capacity
        self.servers: list[grpc.aio.Server] = []
        self.router = Router(window=1.0)
        self.infos: dict[str, ShardInfo] = {}

    async def __aenter__(self) -> Fleet:
        for shard in self.shards:
            server = grpc.aio.server()
            rollout_pb2_grpc.add_RolloutServiceServicer_to_server(shard, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            self.infos[shard.name] = ShardInfo(shard.name, f"127.0.0.1:{port}", self.capacity, 1, 0)
        self.router.start()
        self.router.update_shards(dict(self.infos))
        return self

    async def __aexit__(self, *exc) -> None:
        for shard in self.shards:
            shard.release.set()
        await self.router.stop()
        for server in self.servers:
            await server.stop(0)

    @contextlib.asynccontextmanager
    async def serve_router(self):
        """The router's RolloutService on loopback; yields its port."""
        server = grpc.aio.server()
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RouterServicer(self.router), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            yield port
        finally:
            await server.stop(0)

    def prompt_ids(self, name: str) -> list[str]:
        shard = next(s for s in self.shards if s.name == name)
        return [p.prompt_id for sub in shard.sub_steps for p in sub.prompts]


def step(step_id: str, num_prompts: int, n: int = 2, seed: int | None = None) -> rollout_pb2.SubmitStepRequest:
    req = rollout_pb2.SubmitStepRequest(step_id=step_id, n=n, prompts=[
        common_pb2.Prompt(prompt_id=f"p{i}", token_ids=[3, 4 + i]) for i in range(num_prompts)])
    req.sampling.max_tokens = 8
    if seed is not None:
        req.sampling.seed = seed
    return req


async def weight_chunks(version: int, data: bytes, pieces: int = 1):
    """A push of ``data`` as ``version``: its header, then ``pieces`` chunks."""
    yield common_pb2.WeightChunk(header=common_pb2.WeightHeader(
        version=version, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
    size = -(-len(data) // pieces)
    for i in range(0, len(data), size):
        yield common_pb2.WeightChunk(data=data[i:i + size])


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def collect(router: Router, req) -> list[rollout_pb2.StepEvent]:
    return [e async for e in (await router.submit(req)).follow()]


def samples(events) -> list[rollout_pb2.SampleResult]:
    return [s for e in events for s in event_samples(e)]


@pytest.mark.parametrize("batched", [False, True])
@run_async
async def test_a_group_cut_short_runs_again_elsewhere_without_losing_or_duplicating_a_sample(batched):
    """Shard a returns one sample and dies; its two groups re-run on b, which returns that
    sample again (batched: in a batch with its group's other sample, which goes on alone):
    the trainer gets it once, and every sample has the seed of its (step, prompt, index)
    whichever shard and sub-step ran it."""
    a, b = ScriptedShard("a", fail_after=1), ScriptedShard("b", batched=batched)
    before = duplicates_dropped._value.get()
    async with Fleet(a, b) as fleet:
        req = step("s1", 4)  # no seed: the router derives the step's from its id
        events = await collect(fleet.router, req)
        got = samples(events)
    if batched:  # b's groups went on to the trainer as b batched them
        assert sum(e.HasField("samples") for e in events) >= 2
    keys = [(s.prompt_id, s.sample_index) for s in got]
    assert sorted(keys) == sorted((f"p{i}", k) for i in range(4) for k in range(2)), "lost or duplicated"
    assert a.delivered[0] in b.delivered, "the cut-short group did not run again"
    assert duplicates_dropped._value.get() == before + 1
    seed = step_seed_of(req)
    for s in got:
        assert s.step_id == "s1"
        assert s.seed == sample_seed(seed, "anything", s.prompt_id, s.sample_index)
        assert list(s.token_ids) == [s.seed % 997, 1]


@run_async
async def test_the_shard_that_finishes_first_takes_the_queue():
    """Shard a holds the two groups of its window; b runs the other eight, two at a time
    (its window), before a returns anything."""
    a, b = ScriptedShard("a", held=True), ScriptedShard("b")
    async with Fleet(a, b) as fleet:
        run = await fleet.router.submit(step("s2", 10, seed=3))
        await until(lambda: len(run.delivered) == 16)
        assert len(fleet.prompt_ids("a")) == 2 and len(fleet.prompt_ids("b")) == 8
        assert all(len(sub.prompts) <= 2 for sub in b.sub_steps), "a shard was given more than its window"
        a.release.set()
        events = [e async for e in run.follow()]
    assert len(samples(events)) == 20 and events[-1].summary.num_samples == 20


@run_async
async def test_a_step_that_fits_is_split_in_proportion_to_capacity():
    a, b = ScriptedShard("a", held=True), ScriptedShard("b", held=True)
    async with Fleet(a, b, capacity=8) as fleet:
        fleet.router.update_shards({**fleet.infos, "b": ShardInfo("b", fleet.infos["b"].address, 24, 3, 0)})
        await fleet.router.submit(step("s3", 8))
        await until(lambda: len(a.sub_steps) + len(b.sub_steps) == 2)
        assert (len(fleet.prompt_ids("a")), len(fleet.prompt_ids("b"))) == (2, 6)


@run_async
async def test_a_shard_leaving_the_registry_gives_its_groups_to_the_others():
    a, b = ScriptedShard("a", held=True), ScriptedShard("b")
    async with Fleet(a, b) as fleet:
        run = await fleet.router.submit(step("s4", 6, seed=1))
        await until(lambda: len(run.delivered) == 8)
        fleet.router.update_shards({"b": fleet.infos["b"]})  # a's key expired: it hangs
        await until(lambda: run.finished)
        a.release.set()
    assert sorted(run.delivered) == sorted((f"p{i}", k) for i in range(6) for k in range(2))
    assert len(fleet.prompt_ids("b")) == 6


@run_async
async def test_a_push_waits_for_the_running_step_then_reaches_every_shard_and_reports_route_to_owners():
    a, b = ScriptedShard("a", held=True), ScriptedShard("b")
    async with Fleet(a, b) as fleet, fleet.serve_router() as port:
        await _push_and_report(fleet, a, b, port)


async def _push_and_report(fleet: Fleet, a: ScriptedShard, b: ScriptedShard, port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = rollout_pb2_grpc.RolloutServiceStub(ch)
        events = stub.SubmitStep(step("old", 6, seed=2))
        run = await until_step(fleet.router, "old")
        data = b"x" * 10

        push = asyncio.ensure_future(stub.PushWeights(weight_chunks(1, data)))
        await until(lambda: len(run.delivered) == 8)
        assert not push.done() and a.version == b.version == 0, "the push did not wait for the step"
        a.release.set()
        got = [e async for e in events]
        assert {s.policy_version for s in samples(got)} == {0}
        assert (await push).version == 1 and a.version == b.version == 1
        after = [e async for e in stub.SubmitStep(step("new", 4, seed=2))]
        assert {s.policy_version for s in samples(after)} == {1}

        answer = await stub.ReportRewards(rollout_pb2.ReportRewardsRequest(step_id="old", rewards=[
            rollout_pb2.SampleReward(prompt_id=f"p{i}", sample_index=k, reward=1.0)
            for i in range(6) for k in range(2)]))
        assert answer.num_recorded == 12
        by_shard = {s.name: sorted((r.prompt_id, r.sample_index) for req in s.rewards for r in req.rewards)
                    for s in (a, b)}
        owned = {name: sorted(k for k, sub in run.owner.items() if sub.shard.info.shard_id == name)
                 for name in ("a", "b")}
        assert by_shard == owned and len(owned["a"]) == 4 and len(owned["b"]) == 8
        assert all(req.step_id.startswith("old#") for s in (a, b) for req in s.rewards)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ReportRewards(rollout_pb2.ReportRewardsRequest(step_id="old", rewards=[
                rollout_pb2.SampleReward(prompt_id="p0", sample_index=0, reward=1.0),
                rollout_pb2.SampleReward(prompt_id="p9", sample_index=0, reward=1.0)]))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert err.value.details().startswith("rewards[1].prompt_id")


@run_async
async def test_a_push_whose_header_no_scheduler_would_take_is_refused_at_the_router_and_reaches_no_shard():
    """The router named a file of its weight store by the header's SHA-256 before any
    check: one of 300 characters failed the push INTERNAL (OSError: file name too long,
    its traceback in the router's log), and one that no payload can match reached every
    shard. Now INVALID_ARGUMENT naming the field, as a scheduler answers, and no shard
    sees the push."""
    a, b = ScriptedShard("a"), ScriptedShard("b")
    async with Fleet(a, b) as fleet, fleet.serve_router() as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            for sha256, field in (("a" * 300, "header.sha256"), ("../" * 21 + "x", "header.sha256"),
                                  (hashlib.sha256(b"abc").hexdigest(), "header")):
                async def chunks(sha256=sha256, field=field):
                    if field == "header":  # data before any header
                        yield common_pb2.WeightChunk(data=b"abc")
                    yield common_pb2.WeightChunk(header=common_pb2.WeightHeader(version=1, total_bytes=3,
                                                                                sha256=sha256))
                    yield common_pb2.WeightChunk(data=b"abc")
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.PushWeights(chunks())
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.value.code(), err.value.details())
                assert err.value.details().startswith(field + ":")
            assert a.version == b.version == 0 and fleet.router.version == 0
            assert (await stub.PushWeights(weight_chunks(1, b"abc"))).version == 1  # a good push still goes


@run_async
async def test_a_reward_report_longer_than_its_step_or_for_an_unknown_step_is_refused_before_its_rewards():
    """As a scheduler answers (services/scheduler/rewards.py): the step first (NOT_FOUND,
    whatever its rewards hold), then more rewards than it has samples is INVALID_ARGUMENT
    naming ``rewards``; no shard sees either."""
    a, b = ScriptedShard("a"), ScriptedShard("b")
    async with Fleet(a, b) as fleet, fleet.serve_router() as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            _ = [e async for e in stub.SubmitStep(step("done", 2))]  # 4 samples
            for step_id, k, reward, code, field in (
                    ("done", 5, 1.0, grpc.StatusCode.INVALID_ARGUMENT, "rewards"),
                    ("unknown", 1, float("nan"), grpc.StatusCode.NOT_FOUND, "step_id")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ReportRewards(rollout_pb2.ReportRewardsRequest(step_id=step_id, rewards=[
                        rollout_pb2.SampleReward(prompt_id=f"p{i}", sample_index=0, reward=reward)
                        for i in range(k)]))
                assert err.value.code() == code and err.value.details().startswith(field + ":"), err.value.details()
            assert not a.rewards and not b.rewards


@run_async
async def test_a_reward_for_a_sample_still_running_or_reported_twice_is_refused_as_a_scheduler_does():
    """A held shard's samples have not finished: FAILED_PRECONDITION naming the reward (it
    was NOT_FOUND here and accepted by a scheduler); one sample twice in one report is
    INVALID_ARGUMENT (it was accepted, the last one winning). No shard sees either."""
    a, b = ScriptedShard("a", held=True), ScriptedShard("b")
    async with Fleet(a, b) as fleet, fleet.serve_router() as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            events = stub.SubmitStep(step("r", 6, seed=2))
            run = await until_step(fleet.router, "r")
            await until(lambda: len(run.delivered) == 8)
            keys = [(f"p{i}", k) for i in range(6) for k in range(2)]
            running = next(key for key in keys if key not in run.delivered)
            done = next(iter(run.delivered))

            def reward(key):
                return rollout_pb2.SampleReward(prompt_id=key[0], sample_index=key[1], reward=1.0)

            for rewards, code, field in (([reward(done), reward(running)], grpc.StatusCode.FAILED_PRECONDITION,
                                          "rewards[1]"),
                                         ([reward(done), reward(done)], grpc.StatusCode.INVALID_ARGUMENT, "rewards[1]")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ReportRewards(rollout_pb2.ReportRewardsRequest(step_id="r", rewards=rewards))
                assert err.value.code() == code and err.value.details().startswith(field), err.value.details()
            assert a.rewards == [] and b.rewards == []
            a.release.set()
            assert len(samples([e async for e in events])) == 12


@run_async
async def test_a_logprobs_report_is_checked_whole_in_the_trainers_numbering_before_any_shard_sees_it():
    """A step split over two shards: a bad logprob in the trainer's samples[i] was sent on in
    the part for its shard, which named its position there (another sample), while the
    other shard recorded its part of a report the trainer was told failed."""
    a, b = ScriptedShard("a"), ScriptedShard("b")
    async with Fleet(a, b) as fleet, fleet.serve_router() as port:
        req = step("lp", 4, seed=1)
        req.sampling.logprobs = True
        await collect(fleet.router, req)
        run = fleet.router.steps["lp"]
        assert {sub.shard.info.shard_id for sub in run.owner.values()} == {"a", "b"}
        keys = [(f"p{i}", k) for i in range(4) for k in range(2)]
        bad = next(j for j, key in enumerate(keys) if run.owner[key].shard.info.shard_id == "b"
                   and [run.owner[x] for x in keys[:j]].count(run.owner[key]) > 0)  # not first in its part

        def report(logprobs_of):
            return rollout_pb2.ReportLogprobsRequest(step_id="lp", samples=[
                rollout_pb2.SampleLogprobs(prompt_id=p, sample_index=k, logprobs=logprobs_of(j))
                for j, (p, k) in enumerate(keys)])

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            cases = [
                (report(lambda j: [0.5, -1.0] if j == bad else [-1.0, -1.0]), "INVALID_ARGUMENT",
                 f"samples[{bad}].logprobs[0]"),
                (report(lambda j: [-1.0] if j == bad else [-1.0, -1.0]), "INVALID_ARGUMENT",
                 f"samples[{bad}].logprobs"),
                (report(lambda j: [-1.0, float("nan")] if j == bad else [-1.0, -1.0]), "INVALID_ARGUMENT",
                 f"samples[{bad}].logprobs[1]"),
            ]
            twice = report(lambda j: [-1.0, -1.0])
            twice.samples.append(twice.samples[bad])
            cases.append((twice, "INVALID_ARGUMENT", f"samples[{len(keys)}]"))
            for request, code, field in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.ReportLogprobs(request)
                assert err.value.code() == getattr(grpc.StatusCode, code), err.value.details()
                assert err.value.details().startswith(field + ":"), err.value.details()
            assert not a.logprobs_reports and not b.logprobs_reports, \
                "a shard recorded part of a refused report"
            answer = await stub.ReportLogprobs(report(lambda j: [-1.0, -1.0]))
        assert answer.step.num_samples == 8


@run_async
async def test_a_step_past_the_samples_in_flight_limit_is_resource_exhausted_and_the_running_one_goes_on():
    """A scheduler refuses more samples than it admits in flight; the router took any step
    (4,096 prompts x n 4,096: 16.7M samples, every one kept with its tokens as it passed)."""
    a = ScriptedShard("a", held=True)
    async with Fleet(a) as fleet:
        fleet.router.max_samples_in_flight = 10
        running = await fleet.router.submit(step("first", 4))  # 8 samples
        with pytest.raises(ResourceExhausted, match=r"^prompts: 4 samples would exceed .*\(8 of 10 used\)"):
            await fleet.router.submit(step("second", 2))
        assert "second" not in fleet.router.steps
        a.release.set()
        assert len(samples([e async for e in running.follow()])) == 8
        assert len(samples(await collect(fleet.router, step("second", 2)))) == 4  # room again


@run_async
async def test_a_registry_key_that_does_not_show_a_push_yet_does_not_take_its_version_back():
    """A shard's registry key shows a weight update within a second; a scan in between
    (the old version in the key) must not put the shard, nor the router's stats, back
    on the old version (CI saw the router's GetStats answer 0 right after a push that
    every shard had taken). Past the grace, the key is believed again (a restarted
    shard serving older weights is caught up, not hidden)."""
    a, b = ScriptedShard("a"), ScriptedShard("b")
    async with Fleet(a, b) as fleet, fleet.serve_router() as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            assert (await stub.PushWeights(weight_chunks(1, b"weights"))).version == 1
            fleet.router.update_shards(dict(fleet.infos))  # the keys still say version 0
            assert [s.info.policy_version for s in fleet.router.shards.values()] == [1, 1]
            assert (await stub.GetStats(rollout_pb2.GetStatsRequest())).policy_version == 1
            for shard in fleet.router.shards.values():
                shard.updated_at -= router_core.CATCH_UP_GRACE_S
            fleet.router.update_shards(dict(fleet.infos))
            assert [s.info.policy_version for s in fleet.router.shards.values()] == [0, 0]


@run_async
async def test_a_shard_that_missed_a_push_is_caught_up_with_its_bytes_and_no_step_runs_older_weights():
    """b refuses a push that a takes: the router serves version 1 on a alone; with a gone,
    its version stays 1 (a step waits rather than run on b's version 0) until b, able to
    take updates again, gets the pushed bytes from the router and runs the step."""
    a, b = ScriptedShard("a"), ScriptedShard("b")
    b.refuse_updates = True
    async with Fleet(a, b) as fleet, fleet.serve_router() as port:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            data = b"weights-" * 1000

            pushed = rollout_pb2_grpc.RolloutServiceStub(ch).PushWeights(weight_chunks(1, data, pieces=2))
            assert (await pushed).version == 1
        assert (a.version, b.version, fleet.router.version) == (1, 0, 1)
        fleet.router.update_shards({"b": fleet.infos["b"]})  # a left; b serves 0
        assert fleet.router.version == 1
        run = await fleet.router.submit(step("after", 2, seed=4))
        fleet.router.catch_up()  # b still refuses: it stays behind, and gets no work
        await until(lambda: not fleet.router._catching_up)
        assert not b.sub_steps and not run.finished
        caught = shards_caught_up._value.get()
        b.refuse_updates = False
        fleet.router.catch_up()
        events = [e async for e in run.follow()]
    assert (b.version, b.pushed) == (1, data) and shards_caught_up._value.get() == caught + 1
    assert {s.policy_version for s in samples(events)} == {1} and len(samples(events)) == 4


class Journal:
    """The steps-in-flight record, in memory (the router's is in the registry's Redis)."""

    def __init__(self):
        self.steps: dict[str, int] = {}

    async def step_started(self, step_id: str, version: int) -> None:
        self.steps[step_id] = version

    async def step_finished(self, step_id: str) -> None:
        self.steps.pop(step_id, None)


@run_async
async def test_a_restarted_router_lets_no_push_start_until_the_previous_ones_steps_are_resubmitted():
    """The router started with step "old" in flight under its predecessor (at version 0):
    a push waits until a trainer re-submits "old" and it finishes, so "old" runs again at
    version 0, the version of the samples the trainer already has; steps are journaled
    while they run."""
    a = ScriptedShard("a", held=True)
    journal = Journal()
    async with Fleet(a) as fleet, fleet.serve_router() as port:
        fleet.router.journal = journal
        fleet.router.resume({"old": 0}, wait_s=600.0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            data = b"w" * 10

            push = asyncio.ensure_future(stub.PushWeights(weight_chunks(1, data)))
            other = await fleet.router.submit(step("other", 1, seed=1))  # not the one awaited
            a.release.set()
            await until(lambda: other.finished)
            assert not push.done() and a.version == 0, "the push did not wait for the re-submission"
            a.release.clear()
            events = stub.SubmitStep(step("old", 2, seed=1))
            await until(lambda: "old" in fleet.router.steps and journal.steps == {"old": 0})
            assert not push.done() and a.version == 0, "the push did not wait for the re-submitted step"
            a.release.set()
            got = [e async for e in events]
            assert {s.policy_version for s in samples(got)} == {0} and len(samples(got)) == 4
            assert (await push).version == 1 and a.version == 1
    assert journal.steps == {}


async def until_step(router: Router, step_id: str):
    await until(lambda: step_id in router.steps)
    return router.steps[step_id]


class _Worker:
    def __init__(self, capacity: int):
        self.state = type("State", (), {"capacity": capacity})()
        self.vocab_size, self.max_model_len = 100, 64


class _Core:
    policy_version = 3

    class workers:
        @staticmethod
        def usable():
            return [_Worker(4), _Worker(8)]


@run_async
async def test_a_shard_announces_itself_and_leaves_when_it_stops_or_its_key_expires(clean_redis):
    directory = ShardDirectory(clean_redis)
    announcer = ShardAnnouncer(_Core(), clean_redis, "s0", "10.0.0.1:50051", ttl_s=30)
    announcer.start()
    found = {}
    while not found:
        found = await directory.scan()
    assert found == {"s0": ShardInfo("s0", "10.0.0.1:50051", 12, 2, 3, 100, 64)}
    await announcer.stop()
    assert await directory.scan() == {}  # a clean exit deletes its key

    hung = ShardAnnouncer(_Core(), clean_redis, "s1", "10.0.0.2:50051", ttl_s=0.3)
    await hung.announce()  # announced once, then silent: the key expires
    assert "s1" in await directory.scan()
    while await directory.scan():
        await asyncio.sleep(0.05)
    await hung.client.aclose()
    await directory.close()


@run_async
async def test_two_releases_sharing_one_redis_keep_their_shards_and_steps_apart(clean_redis):
    """Every release names its shards shard-0, shard-1, ...: under one key prefix release B's
    announcements overwrote A's, and A's router sent its steps to B's schedulers."""
    a_dir, b_dir = ShardDirectory(clean_redis, "rl-a"), ShardDirectory(clean_redis, "rl-b")
    a = ShardAnnouncer(_Core(), clean_redis, "shard-0", "a-scheduler-0:50051", ttl_s=30, key_prefix="rl-a")
    b = ShardAnnouncer(_Core(), clean_redis, "shard-0", "b-scheduler-0:50051", ttl_s=30, key_prefix="rl-b")
    glob = ShardAnnouncer(_Core(), clean_redis, "shard-0", "c-scheduler-0:50051", ttl_s=30, key_prefix="rl-*")
    for announcer in (a, b, glob):
        await announcer.announce()
    assert {k: v.address for k, v in (await a_dir.scan()).items()} == {"shard-0": "a-scheduler-0:50051"}
    assert {k: v.address for k, v in (await b_dir.scan()).items()} == {"shard-0": "b-scheduler-0:50051"}
    # a prefix with glob characters matches itself only, not the other releases' keys
    assert [v.address for v in (await ShardDirectory(clean_redis, "rl-*").scan()).values()] == ["c-scheduler-0:50051"]
    await a_dir.step_started("step-1", 4)
    assert await b_dir.steps_in_flight() == {} and await a_dir.steps_in_flight() == {"step-1": 4}
    for announcer in (a, b, glob):
        await announcer.stop()
    assert await a_dir.scan() == {} and await b_dir.scan() == {}
    await a_dir.close()
    await b_dir.close()


@pytest.mark.parametrize("prefix", ["", "rl{a}", "}"])
def test_a_key_prefix_with_braces_or_empty_is_refused_naming_the_setting(prefix, monkeypatch):
    from pydantic import ValidationError

    from services.router.settings import RouterSettings
    from services.scheduler.settings import SchedulerSettings

    for cls, var in ((RouterSettings, "RHYMERL_ROUTER_KEY_PREFIX"), (SchedulerSettings, "RHYMERL_SCHEDULER_KEY_PREFIX")):
        monkeypatch.setenv(var, prefix)
        with pytest.raises(ValidationError, match="key_prefix"):
            cls()


@run_async
async def test_finished_steps_are_forgotten_oldest_first_within_the_sample_bound():
    async with Fleet(ScriptedShard("a")) as fleet:
        fleet.router.max_samples_retained = 20  # two steps of 8 samples, not three
        for i in range(3):
            await collect(fleet.router, step(f"r{i}", 4))
        assert list(fleet.router.steps) == ["r1", "r2"]
        with pytest.raises(Exception, match="no step 'r0'"):
            fleet.router.get("r0")


@run_async
async def test_a_cancel_aborts_the_queued_groups_and_cancels_the_running_sub_steps():
    a = ScriptedShard("a", held=True)
    async with Fleet(a) as fleet:
        run = await fleet.router.submit(step("c", 5))  # a's window: 2 groups; 3 queued
        await until(lambda: len(a.sub_steps) == 1)
        assert await fleet.router.cancel("c") == 3 * 2 + 2 * 2
        events = [e async for e in run.follow()]
    got = samples(events)
    assert sorted((s.prompt_id, s.sample_index) for s in got) == sorted((f"p{i}", k) for i in range(5) for k in range(2))
    assert all(s.finish_reason == common_pb2.FINISH_REASON_ABORT for s in got)
    assert a.cancelled == {a.sub_steps[0].step_id} and events[-1].summary.num_samples == 10


@run_async
async def test_a_step_whose_trainer_went_is_cancelled_on_its_shards_after_the_timeout():
    """The trainer's SubmitStep call to the router ends (Ctrl-C, a crash): the step is no
    longer followed, and after abandoned_step_timeout_s the router cancels it, its running
    sub-step on the shard too (which the router itself still follows, so the shard's own
    timeout would never fire); while a trainer follows, it is never cancelled."""
    a = ScriptedShard("a", held=True)
    async with Fleet(a) as fleet:
        fleet.router.abandoned_step_timeout_s = 30.0
        async with fleet.serve_router() as port, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = rollout_pb2_grpc.RolloutServiceStub(ch).SubmitStep(step("gone", 3))
            await until(lambda: "gone" in fleet.router.steps and fleet.router.steps["gone"].num_followers == 1)
            routed = fleet.router.steps["gone"]
            await until(lambda: len(a.sub_steps) == 1)
            assert fleet.router.cancel_abandoned(routed.started + 1e6) == []  # followed
            call.cancel()
            await until(lambda: routed.num_followers == 0)
        since = routed.unfollowed_since
        assert fleet.router.cancel_abandoned(since + 29.0) == []
        assert fleet.router.cancel_abandoned(since + 31.0) == ["gone"]
        events = [e async for e in routed.follow()]
    assert a.cancelled == {a.sub_steps[0].step_id}
    assert all(s.finish_reason == common_pb2.FINISH_REASON_ABORT for s in samples(events))
    assert len(samples(events)) == 6 and events[-1].HasField("summary")


@run_async
async def test_groups_no_shard_can_take_end_as_abort_with_the_reason():
    """A step at version 0 while the only shard serves 1 (it took a push the router has
    not seen): after no_shard_timeout_s its groups end ABORT, each saying why."""
    a = ScriptedShard("a")
    async with Fleet(a) as fleet:
        run = await fleet.router.submit(step("stuck", 2))
        fleet.router.update_shards({"a": ShardInfo("a", fleet.infos["a"].address, 4, 1, 1)})
        run.version = 0  # submitted before the shard moved on
        fleet.router.assign()
        assert not a.sub_steps or run.finished
        fleet.router.no_shard_timeout_s = 0.0
        fleet.router.expire_waiting()
        events = [e async for e in run.follow()]
    aborted = [s for s in samples(events) if s.finish_reason == common_pb2.FINISH_REASON_ABORT]
    assert len(aborted) == 4 - len(a.delivered)
    assert all("no scheduler shard served version 0" in s.error for s in aborted)
