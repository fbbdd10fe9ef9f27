"""The chaos campaign's faults: what a cluster does to a running RL loop, drawn from a
seeded schedule and applied to real processes (``LocalCluster``).

Kinds: kill -9 or SIGTERM of a worker, the scheduler, history or Redis (each restarted
after a moment, as Kubernetes would); a weight push in the middle of the trainers'
steps; every worker killed right after a push of the weights' bytes, and restarted on
their initial weights (the fleet must bring them to the pushed version by itself, with
no trainer action); a step cancelled mid-way (some samples ABORT) and submitted again
under its id (finished samples replayed, aborted ones generated again: the ledger
checks every token against the fault-free run); and bad input of every kind the
contract names, sent while steps run (each must get its status code;
``bad_input_mismatch`` counts the ones that did not).

Sharded (``SHARDED_KINDS``, a ``ShardedCluster``: a step router in front of scheduler
shards, each with its own history and workers): kill -9 or SIGTERM of a shard's
scheduler while it runs a sub-step (``mid_step`` counts the kills that found one
running), of the router while it routes a step, of a shard's worker, history or Redis
(its step log); the weight, cancel and bad-input faults go through the router.
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import grpc
from rhymerl.types import event_samples
from rhymerl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

from benchmarks.chaos_trainer import MAX_N, SEEDS, StepPlan, prompt_pool, run_step
from services.local import LocalCluster

log = logging.getLogger("chaos")
PROCESS_FAULTS = ["kill9_worker", "sigterm_worker", "kill9_scheduler", "sigterm_scheduler", "kill9_history",
                  "sigterm_history", "kill9_redis", "sigterm_redis"]
CALL_FAULTS = ["weight_push", "bad_input", "kill_all_workers_after_push", "resubmit_aborted_step"]
KINDS = PROCESS_FAULTS + CALL_FAULTS
SHARDED_KINDS = ["kill9_shard", "sigterm_shard", "kill9_router", "sigterm_router", "kill9_worker", "sigterm_worker",
                 "kill9_history", "kill9_redis"] + CALL_FAULTS
WEIGHTS = {"weight_push": 3, "bad_input": 3, "kill9_worker": 3, "kill9_scheduler": 2, "kill9_shard": 3,
           "kill9_router": 2}  # others: 1


class Faults(threading.Thread):
    """Injects ``num_faults`` faults, one every 0.5-2.5 s, then sets ``done``.

    Args:
        cluster: a ``LocalCluster``, or a ``ShardedCluster`` with ``kinds=SHARDED_KINDS``.
        checkpoints: the two weight sets; version v loads ``checkpoints[v % 2]``.
        bad_payload: safetensors bytes with a NaN in one tensor.
    """

    def __init__(self, cluster: LocalCluster, seed: int, num_faults: int, checkpoints: list[Path],
                 bad_payload: bytes, on_step=None, step_deadline_s: float = 300.0, kinds: list[str] = KINDS):
        super().__init__(name="faults", daemon=True)
        self.cluster, self.rng, self.num_faults, self.kinds = cluster, random.Random(seed), num_faults, kinds
        self.checkpoints, self.bad_payload = checkpoints, bad_payload
        self.on_step, self.step_deadline_s = on_step, step_deadline_s  # the ledger checks re-submitted steps
        self.num_aborted_regenerated = 0  # samples that ended ABORT (cancel) and came back generated
        self.counts: Counter = Counter()
        self.bad_input_mismatch: list[str] = []
        self.reregister_s: list[float] = []  # scheduler (or shard) restarted -> its fleet serving again
        self.router_back_s: list[float] = []  # router restarted -> ready with every shard
        self.mid_step: Counter = Counter()  # kills of a shard or the router that found a step running
        self.groups_requeued = 0  # groups the router ran again elsewhere after the shard kills
        self.done = threading.Event()
        self.error: BaseException | None = None

    def schedule(self) -> list[str]:
        """Every kind at least once (when there is room), then weighted draws; shuffled."""
        kinds = self.kinds[:self.num_faults] if self.num_faults < len(self.kinds) else list(self.kinds)
        weights = [WEIGHTS.get(k, 1) for k in self.kinds]
        kinds += self.rng.choices(self.kinds, weights, k=self.num_faults - len(kinds))
        self.rng.shuffle(kinds)
        return kinds

    def run(self) -> None:
        try:
            for kind in self.schedule():
                time.sleep(self.rng.uniform(0.5, 2.5))
                log.info("fault: %s", kind)
                getattr(self, kind.split("_", 1)[0] if kind.startswith(("kill9", "sigterm")) else kind)(kind)
                self.counts[kind] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the campaign
            self.error = exc
        finally:
            self.done.set()

    # --- processes -----------------------------------------------------------------
    def kill9(self, kind: str) -> None:
        self._kill(kind, signal.SIGKILL)

    def sigterm(self, kind: str) -> None:
        self._kill(kind, signal.SIGTERM)

    def _kill(self, kind: str, sig: int) -> None:
        target = kind.split("_", 1)[1]
        if target == "shard":
            self._kill_shard(kind, sig)
            return
        if target == "router":
            self._kill_router(kind, sig)
            return
        if target == "worker":
            name = self.rng.choice(self.cluster.workers)
        elif hasattr(self.cluster, "shards"):  # a shard's history or Redis
            name = f"shard-{self.rng.randrange(len(self.cluster.shards))}/{target}"
        else:
            name = target
        serving = self._num_serving_workers() if name == "scheduler" else 0
        self.cluster.kill(name, sig, timeout_s=90)
        time.sleep(self.rng.uniform(0.0, 1.5))  # the pod is rescheduled after a moment
        respawned = time.monotonic()
        self.cluster.restart(name, wait=False)
        if name == "scheduler":  # the fleet must register again by itself
            self.cluster.wait_registered(120, expected=serving)
            self.reregister_s.append(time.monotonic() - respawned)

    def _kill_shard(self, kind: str, sig: int) -> None:
        """A shard's scheduler killed while it runs a sub-step, restarted after a moment;
        the next fault waits until its workers registered again and the router gives it
        work."""
        index = self.rng.randrange(len(self.cluster.shards))
        address = self.cluster.shards[index].scheduler_address
        serving = self._num_serving_workers(address)
        requeued = self._router_requeued()
        self.mid_step[kind] += self._wait_step_running(address)
        self.cluster.kill(f"shard-{index}/scheduler", sig, timeout_s=90)
        time.sleep(self.rng.uniform(0.0, 1.5))
        respawned = time.monotonic()
        self.cluster.restart(f"shard-{index}/scheduler", wait=False)
        self.cluster.wait_shard_serving(index, 120, expected=serving)
        self.reregister_s.append(time.monotonic() - respawned)
        self.groups_requeued += self._router_requeued() - requeued

    def _router_requeued(self) -> float:
        """The router's count of groups taken back from a shard (its process's, so far)."""
        return sum(s.value for s in self.cluster.router_metrics()
                   if s.name == "rhymerl:router_groups_requeued_total")

    def _kill_router(self, kind: str, sig: int) -> None:
        """The router killed while it routes a step, restarted after a moment: it comes
        back knowing no step, and the trainers' re-submissions run theirs again."""
        self.mid_step[kind] += self._wait_step_running(self.cluster.address)
        self.cluster.kill("router", sig, timeout_s=90)
        time.sleep(self.rng.uniform(0.0, 1.5))
        respawned = time.monotonic()
        self.cluster.restart("router", timeout_s=120)
        self.router_back_s.append(time.monotonic() - respawned)

    def _wait_step_running(self, address: str, timeout_s: float = 60.0) -> bool:
        """Until the scheduler (or router) at ``address`` runs a step; False if none came."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(address) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            while time.monotonic() < deadline:
                try:
                    if stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10).num_steps_running:
                        return True
                except grpc.RpcError:
                    pass
                time.sleep(0.05)
        return False

    def _num_serving_workers(self, address: str = "") -> int:
        with grpc.insecure_channel(address or self.cluster.scheduler_address) as ch:
            try:
                stats = rollout_pb2_grpc.RolloutServiceStub(ch).GetStats(rollout_pb2.GetStatsRequest(), timeout=10)
            except grpc.RpcError:
                return 0
        return sum(w.healthy for w in stats.workers)

    # --- weights and bad input -----------------------------------------------------------
    def weight_push(self, kind: str, as_bytes: bool = False) -> None:
        """The next version, from the checkpoint of its parity (retried like a trainer):
        its path, or (``as_bytes``) its bytes pushed."""
        from rhymerl._calls import weight_chunks

        for _ in range(30):
            try:
                with grpc.insecure_channel(self.cluster.scheduler_address) as ch:
                    stub = rollout_pb2_grpc.RolloutServiceStub(ch)
                    version = stub.GetStats(rollout_pb2.GetStatsRequest(), timeout=10).policy_version + 1
                    checkpoint = self.checkpoints[version % 2]
                    if as_bytes:
                        data = (checkpoint / "model.safetensors").read_bytes()
                        stub.PushWeights(iter(weight_chunks(version, data)), timeout=120)
                    else:
                        stub.LoadWeights(common_pb2.LoadWeightsRequest(version=version, path=str(checkpoint)),
                                         timeout=120)
                    return
            except grpc.RpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                      grpc.StatusCode.FAILED_PRECONDITION):
                    raise
                time.sleep(1.0)

    def kill_all_workers_after_push(self, kind: str) -> None:
        """A push of bytes, then every worker kill -9'd and restarted on its initial
        weights: the trainers' steps must go on at the pushed version by themselves."""
        self.weight_push(kind, as_bytes=True)
        for name in self.cluster.workers:
            self.cluster.kill(name, signal.SIGKILL, timeout_s=90)
        time.sleep(self.rng.uniform(0.0, 1.5))
        for name in self.cluster.workers:
            self.cluster.restart(name, wait=False)

    def resubmit_aborted_step(self, kind: str) -> None:
        """A step cancelled once its first sample arrived (the rest ABORT), then submitted
        again under its id: the ledger checks the second delivery like any step's."""
        pool = prompt_pool()
        number = self.counts[kind]
        plan = StepPlan(f"aborted/{number}", {p: pool[p] for p in self.rng.sample(sorted(pool), 4)}, MAX_N,
                        self.rng.choice(SEEDS))
        cancelled, aborted = False, 0
        with grpc.insecure_channel(self.cluster.scheduler_address) as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            try:
                for event in stub.SubmitStep(plan.request(), timeout=60):
                    samples = event_samples(event)
                    if not samples:
                        continue
                    aborted += sum(s.finish_reason == common_pb2.FINISH_REASON_ABORT for s in samples)
                    if not cancelled:
                        cancelled = True
                        stub.CancelStep(rollout_pb2.CancelStepRequest(step_id=plan.step_id), timeout=30)
            except grpc.RpcError as err:  # another fault broke it: the re-submission below covers it
                log.info("aborted step %s: first submission ended with %s", plan.step_id, err.code())
        out = run_step(self.cluster.scheduler_address, plan, self.step_deadline_s)
        self.num_aborted_regenerated += aborted * out.complete
        if self.on_step is not None:
            self.on_step(out)

    def bad_input(self, kind: str) -> None:
        name, call, expected = self.rng.choice(self._bad_inputs())
        for _ in range(30):
            try:
                with grpc.insecure_channel(self.cluster.scheduler_address) as ch:
                    call(rollout_pb2_grpc.RolloutServiceStub(ch), ch)
                got = grpc.StatusCode.OK
            except grpc.RpcError as err:
                got = err.code()
            if got not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                break
            time.sleep(1.0)
        self.counts[f"bad_input:{name}"] += 1
        if got != expected:
            self.bad_input_mismatch.append(f"{name}: {got.name}, expected {expected.name}")

    def _bad_inputs(self):
        good = dict(n=1, sampling=common_pb2.SamplingParams(max_tokens=4),
                    prompts=[common_pb2.Prompt(prompt_id="q", token_ids=[3, 4])])
        data = self.bad_payload
        nan_push = [common_pb2.WeightChunk(header=common_pb2.WeightHeader(
            version=10**9, total_bytes=len(data), sha256=hashlib.sha256(data).hexdigest())),
            common_pb2.WeightChunk(data=data)]
        corrupt = [common_pb2.WeightChunk(header=common_pb2.WeightHeader(
            version=10**9, total_bytes=len(data), sha256=hashlib.sha256(b"other").hexdigest())),
            common_pb2.WeightChunk(data=data)]

        def submit(**change):
            return lambda stub, ch: list(stub.SubmitStep(rollout_pb2.SubmitStepRequest(
                **{"step_id": "bad", **good, **change}), timeout=30))

        def rewards(step_id, index, reward):
            return lambda stub, ch: stub.ReportRewards(rollout_pb2.ReportRewardsRequest(
                step_id=step_id, rewards=[rollout_pb2.SampleReward(prompt_id="b", sample_index=index,
                                                                   reward=reward)]), timeout=30)

        def non_utf8(stub, ch):
            call = ch.unary_stream("/rhymerl.v1.RolloutService/SubmitStep",
                                   response_deserializer=rollout_pb2.StepEvent.FromString)
            list(call(b"\x0a\x02\xff\xfe\x20\x01", timeout=30))

        invalid, missing = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
        return [
            ("huge_step_id", submit(step_id="s" * 3_000_000), invalid),
            ("n_zero", submit(n=0), invalid),
            ("token_out_of_vocab", submit(prompts=[common_pb2.Prompt(prompt_id="q", token_ids=[5, 10**6])]),
             invalid),
            ("negative_policy_version", submit(policy_version=-1), invalid),
            ("non_utf8_step_id", non_utf8, invalid),
            ("reward_negative_index", rewards("t0/s0", -1, 1.0), invalid),
            ("reward_nan", rewards("t0/s0", 0, math.nan), invalid),
            ("reward_unknown_step", rewards("never-submitted", 0, 1.0), missing),
            ("cancel_unknown_step", lambda stub, ch: stub.CancelStep(
                rollout_pb2.CancelStepRequest(step_id="never-submitted"), timeout=30), missing),
            ("push_corrupt", lambda stub, ch: stub.PushWeights(iter(corrupt), timeout=120),
             grpc.StatusCode.DATA_LOSS),
            ("push_nan_weights", lambda stub, ch: stub.PushWeights(iter(nan_push), timeout=120), invalid),
            ("load_older_version", lambda stub, ch: stub.LoadWeights(common_pb2.LoadWeightsRequest(
                version=0, path=str(self.checkpoints[0])), timeout=30), grpc.StatusCode.FAILED_PRECONDITION),
        ]
