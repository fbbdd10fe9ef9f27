"""The real processes, as `make run` and a deployment start them: CLI, env settings,
health, registration, /metrics, and a worker that drains on SIGTERM."""

from __future__ import annotations

import signal

import pytest
from rhymerl import Prompt, RolloutClient, SamplingParams

from services.local import LocalCluster
from tests.e2e.cluster import save_tiny_model

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def test_processes_serve_a_step_export_metrics_and_drain(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    cluster = LocalCluster(model_dir=str(model), num_workers=2, policy="seer", chunk_tokens=16,
                           log_dir=tmp_path / "logs")
    with cluster:
        with RolloutClient(cluster.scheduler_address, timeout_s=120) as client:
            params = SamplingParams(temperature=0.0, max_tokens=32, seed=0, ignore_eos=True)
            ps = [Prompt(f"q{i}", [3 + i, 5, 7, 9]) for i in range(4)]
            first = client.rollout("s1", ps, n=2, sampling=params)
            second = client.rollout("s2", ps, n=2, sampling=params)
            assert len(first.samples) == len(second.samples) == 8
            assert second.summary.history_hit_rate == 1.0

            workers = [f"worker-{i}" for i in range(2)]
            generated = sum(metric(cluster.scrape(w), "rhymerl:generation_tokens_total")
                            for w in workers)
            assert generated == first.summary.num_generated_tokens + second.summary.num_generated_tokens
            accepted = sum(metric(cluster.scrape(w), "rhymerl:spec_decode_num_accepted_tokens_total")
                           for w in workers)
            assert accepted == second.summary.num_accepted_tokens + first.summary.num_accepted_tokens
            sched = cluster.scrape("scheduler")
            assert metric(sched, 'rhymerl:samples_total{finish_reason="length"}') == 16
            assert "rhymerl:step_bubble_ratio" in sched
            assert metric(cluster.scrape("history"), "rhymerl:history_rollouts_written_total") == 16

            # SIGTERM: the worker leaves the fleet, and the next step runs on the other one.
            cluster.procs["worker-1"].send_signal(signal.SIGTERM)
            assert cluster.procs["worker-1"].wait(30) == 0
            third = client.rollout("s3", ps, n=2, sampling=params)
            assert {s.key: s.token_ids for s in third.samples} == {s.key: s.token_ids for s in first.samples}
            assert [w.worker_id for w in client.stats().workers] == ["worker-0"]


def test_scheduler_kill_9_mid_step_loses_nothing_and_regenerates_only_the_missing(tmp_path):
    """kill -9 of the scheduler mid-step, then a new one: the workers register again, and
    the trainer re-submitting the step id gets every sample once, with the tokens of a
    quiet run; the samples the trainer had already seen are replayed from the step log
    in Redis, not generated again."""
    import grpc
    from rhymerl import _calls
    from rhymerl.v1 import rollout_pb2_grpc

    from tests.e2e.cluster import prompts

    model = save_tiny_model(tmp_path / "model")
    cluster = LocalCluster(model_dir=str(model), num_workers=2, policy="rhymerl", chunk_tokens=8,
                           log_dir=tmp_path / "logs", separate_redis=True)
    params = SamplingParams(temperature=1.0, max_tokens=200, seed=3)
    ps = prompts(6, offset=20)
    with cluster:
        with RolloutClient(cluster.scheduler_address, timeout_s=120) as client:
            reference = {s.key: s.token_ids for s in client.rollout("quiet", ps, n=4, sampling=params).samples}
        request = _calls.step_request("killed", ps, 4, params, 0)
        seen = {}
        with grpc.insecure_channel(cluster.scheduler_address) as channel:
            events = rollout_pb2_grpc.RolloutServiceStub(channel).SubmitStep(request, timeout=120)
            for event in events:
                if event.HasField("sample"):
                    seen[(event.sample.prompt_id, event.sample.sample_index)] = list(event.sample.token_ids)
                if len(seen) >= 8:
                    cluster.kill("scheduler")
                    break
        assert len(seen) < 24, "the step ended before the kill: the test proves nothing"
        cluster.restart("scheduler", wait=False)
        cluster.wait_registered(60)  # a hang guard: the fleet registers again by itself
        with RolloutClient(cluster.scheduler_address, timeout_s=120, max_retries=10) as client:
            again = client.rollout("killed", ps, n=4, sampling=params)
            generated_after = client.stats().num_generated_tokens
        got = {s.key: s.token_ids for s in again.samples}
        assert sorted(got) == sorted(reference) and len(again.samples) == 24
        assert got == reference
        assert all(got[k] == tokens for k, tokens in seen.items())
        total = sum(len(t) for t in reference.values())
        assert generated_after <= total - sum(len(t) for t in seen.values())
