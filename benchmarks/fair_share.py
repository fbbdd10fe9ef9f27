"""How long does a small step take beside a huge one? (The chaos campaign's fair-share
figure; the services are the campaign's real processes.)

A trainer's 4 prompts x 4 samples x 64 tokens, and a very small step of 2 x 2 x 16
tokens (the issue-29 case that once took 11x its time alone), each timed alone, then while another trainer's
16 x 4096 = 65,536-sample step holds the fleet; meanwhile a probe times the
scheduler's health check. Medians of ``repeats`` runs, each under its own step id (a
re-used id would replay instead of generate). Beside each time, the workers' mean engine
step time in the same window (their engine_step_seconds histograms): a small step's
tokens are computed in the big step's batches, so its time grows at least by that
step-time ratio whatever the scheduler does (on a CPU, where a step's cost grows with
the batch; on a GPU decode steps cost about the same at batch 8 and 64).
"""

from __future__ import annotations

import statistics
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.local import LocalCluster

SMALL = dict(temperature=1.0, max_tokens=64, seed=5, ignore_eos=True)
TINY = dict(temperature=1.0, max_tokens=16, seed=7, ignore_eos=True)
BIG = dict(temperature=1.0, max_tokens=64, seed=6, ignore_eos=True)


def _prompts(k: int, offset: int):
    from rhymerl import Prompt

    return [Prompt(f"f{offset + i}", [2 + (13 * (offset + i) + 7 * j) % 90 for j in range(6)]) for i in range(k)]


def _engine_step_totals(cluster: LocalCluster) -> tuple[float, float]:
    """(sum of seconds, count) of every worker's engine steps so far."""
    counters = cluster.engine_counters()
    return (sum(v for k, v in counters.items() if k.endswith("_s")),
            sum(v for k, v in counters.items() if k.endswith("_steps")))


def _mean_step_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    steps = after[1] - before[1]
    return round(1000 * (after[0] - before[0]) / steps, 2) if steps else None


def _time_small(client, tag: str, repeats: int, prompts: int = 4, n: int = 4, sampling: dict = SMALL) -> float:
    from rhymerl import SamplingParams

    times = []
    for r in range(repeats):
        started = time.monotonic()
        result = client.rollout(f"small/{tag}/{prompts}x{n}/{r}", _prompts(prompts, 0), n=n,
                                sampling=SamplingParams(**sampling))
        assert len(result.samples) == prompts * n
        times.append(time.monotonic() - started)
    return statistics.median(times)


def measure_fair_share(cluster: LocalCluster, repeats: int = 3) -> dict:
    from rhymerl import RolloutClient, SamplingParams

    address = cluster.scheduler_address
    with RolloutClient(address, timeout_s=600, max_retries=3) as client:
        mark = _engine_step_totals(cluster)
        alone = _time_small(client, "alone", repeats)
        tiny_alone = _time_small(client, "alone", repeats, 2, 2, TINY)
        step_ms_alone = _mean_step_ms(mark, _engine_step_totals(cluster))
        got, stop, health_s = [], threading.Event(), []

        def big():
            with RolloutClient(address, timeout_s=3600, max_retries=0) as c:
                got.extend(c.submit_step("big", _prompts(16, 100), n=4096, sampling=SamplingParams(**BIG)))

        def probe():
            with grpc.insecure_channel(address) as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                while not stop.is_set():
                    started = time.monotonic()
                    stub.Check(health_pb2.HealthCheckRequest(service="rhymerl.v1.RolloutService"), timeout=60)
                    health_s.append(time.monotonic() - started)
                    stop.wait(0.2)

        threads = [threading.Thread(target=big, daemon=True), threading.Thread(target=probe, daemon=True)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 300
        while not any(w.num_running for w in client.stats().workers):
            if time.monotonic() > deadline:
                raise TimeoutError("the big step never started")
            time.sleep(0.2)
        mark = _engine_step_totals(cluster)
        beside = _time_small(client, "beside", repeats)
        tiny_beside = _time_small(client, "beside", repeats, 2, 2, TINY)
        step_ms_beside = _mean_step_ms(mark, _engine_step_totals(cluster))
        big_done_when_small_done = len(got)
        client.cancel_step("big")
        threads[0].join(600)
        stop.set()
        threads[1].join(60)
    return {"small_alone_s": round(alone, 3), "small_beside_big_s": round(beside, 3),
            "ratio": round(beside / alone, 2), "big_samples": 16 * 4096,
            "big_samples_done_meanwhile": big_done_when_small_done,
            "engine_step_ms_alone": step_ms_alone, "engine_step_ms_beside": step_ms_beside,
            "engine_step_ratio": round(step_ms_beside / step_ms_alone, 2) if step_ms_alone and step_ms_beside else None,
            "health_check_max_s": round(max(health_s), 3) if health_s else None,
            "tiny_alone_s": round(tiny_alone, 3), "tiny_beside_big_s": round(tiny_beside, 3),
            "tiny_ratio": round(tiny_beside / tiny_alone, 2)}
