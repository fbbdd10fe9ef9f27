"""The chaos campaign's trainers: each runs steps against the cluster as a real trainer
would (re-submitting a step id after any break), and records what every SubmitStep
stream delivered, so the campaign can check the invariants after each step:

  - every (prompt, sample) delivered (none lost), within the step's deadline (no hang);
  - none twice in one stream, and a re-delivery after a re-submission identical to the
    first (none duplicated);
  - tokens identical to the fault-free run of the same seeds and weights.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import grpc
from rhymerl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc

RETRY = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
         grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
SAMPLING = dict(temperature=1.0, top_p=1.0, max_tokens=48, logprobs=True)
SEEDS = (11, 12)  # step seeds (explicit: the sample seeds depend on them, not on step ids)
MAX_N = 8


def prompt_pool() -> dict[str, list[int]]:
    """Prompt ids chosen to collide when joined with step ids ("X/a" + "b" vs "X" + "a/b")."""
    ids = ["b", "a/b", "p0", "p1", "p2", "p3", "p/4", "p5"]
    return {pid: [2 + (11 * i + 5 * j) % 90 for j in range(4 + i % 3)] for i, pid in enumerate(ids)}


@dataclass
class StepPlan:
    step_id: str
    prompts: dict[str, list[int]]
    n: int
    seed: int

    def request(self) -> rollout_pb2.SubmitStepRequest:
        return rollout_pb2.SubmitStepRequest(
            step_id=self.step_id, n=self.n, sampling=common_pb2.SamplingParams(seed=self.seed, **SAMPLING),
            prompts=[common_pb2.Prompt(prompt_id=p, token_ids=t) for p, t in self.prompts.items()])


def plan_step(seed: int, trainer: int, i: int) -> StepPlan:
    """Step ``i`` of a trainer: its own, one of a colliding pair, or a duplicate (the
    same content from every trainer); the kind depends on (seed, i) only, so trainers
    agree on the shared ones."""
    pool, rng = prompt_pool(), random.Random(seed * 100_003 + i)
    kind = rng.choice(["own", "own", "collide", "dup"])
    step_seed, n = rng.choice(SEEDS), rng.choice([4, MAX_N])
    if kind == "collide":
        step_id, prompts = (f"X{i}/a", ["b"]) if trainer % 2 == 0 else (f"X{i}", ["a/b"])
        prompts += rng.sample(["p0", "p1", "p2"], 1)
    elif kind == "dup":
        step_id, prompts = f"dup/{i}", rng.sample(sorted(pool), 4)
    else:
        step_id, prompts = f"t{trainer}/s{i}", random.Random(seed * 7 + trainer * 1009 + i).sample(sorted(pool), 4)
    return StepPlan(step_id, {p: pool[p] for p in prompts}, n, step_seed)


@dataclass
class StepOutcome:
    plan: StepPlan
    samples: dict[tuple[str, int], rollout_pb2.SampleResult] = field(default_factory=dict)
    duplicated: int = 0  # delivered twice in one stream, or again with other tokens
    attempts: int = 0
    complete: bool = False
    error: str = ""
    seconds: float = 0.0


def run_step(address: str, plan: StepPlan, deadline_s: float) -> StepOutcome:
    """Submits the step, re-submitting its id after any break, until its summary arrives
    or ``deadline_s`` passes (then it hung)."""
    out, started = StepOutcome(plan), time.monotonic()
    request = plan.request()
    with grpc.insecure_channel(address) as channel:
        stub = rollout_pb2_grpc.RolloutServiceStub(channel)
        while time.monotonic() - started < deadline_s and not out.complete:
            out.attempts += 1
            in_stream: set[tuple[str, int]] = set()
            try:
                for event in stub.SubmitStep(request, timeout=min(60.0, deadline_s)):
                    if event.HasField("summary"):
                        out.complete = True
                        continue
                    s = event.sample
                    key = (s.prompt_id, s.sample_index)
                    first = out.samples.setdefault(key, s)
                    out.duplicated += key in in_stream or list(first.token_ids) != list(s.token_ids)
                    in_stream.add(key)
            except grpc.RpcError as err:
                if err.code() not in RETRY:
                    out.error = f"{err.code().name}: {err.details()}"
                    break
                time.sleep(min(2.0, 0.1 * 2 ** min(out.attempts, 5)) * random.uniform(0.5, 1.0))
    out.seconds = time.monotonic() - started
    return out


class Trainer(threading.Thread):
    """Runs its steps one after the other until ``stop`` is set (and at least one ran)."""

    def __init__(self, index: int, seed: int, address: str, stop: threading.Event, deadline_s: float,
                 on_step):
        super().__init__(name=f"trainer-{index}", daemon=True)
        self.index, self.seed, self.address, self.stop, self.deadline_s = index, seed, address, stop, deadline_s
        self.on_step = on_step

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            self.on_step(run_step(self.address, plan_step(self.seed, self.index, i), self.deadline_s))
            i += 1
