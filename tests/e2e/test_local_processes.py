"""The real processes, as `make run` and a deployment start them: CLI, env settings,
health, registration, /metrics, and a worker that drains on SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from rhymerl import Prompt, RolloutClient, SamplingParams
from rhymerl.types import event_samples

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
    # each worker process runs its collections behind its steps' forwards (RHYMERL_WORKER_GC_THRESHOLDS)
    for w in ("worker-0", "worker-1"):
        assert "collections behind each step's forward at thresholds (700, 10, 100)" in \
            (tmp_path / "logs" / f"{w}.log").read_text()


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
                for s in event_samples(event):
                    seen[(s.prompt_id, s.sample_index)] = list(s.token_ids)
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


def test_samples_streamed_while_redis_was_down_are_replayed_after_a_restart_and_a_push(tmp_path):
    """Redis kill -9'd while a step streams (restarted once a step-log write met it),
    then the scheduler kill -9'd and restarted and version 1 pushed before the trainer
    re-submits the step id: every sample comes back as the trainer first saw it (version
    0, its tokens), none is generated again at version 1. The long chaos run's 5
    duplicates (issue 29): the log skipped writes for 5 s while samples streamed, and a
    restarted scheduler generated them again at the pushed version, other tokens under
    the same (prompt, sample index)."""
    import threading

    import grpc
    from rhymerl import _calls
    from rhymerl.v1 import rollout_pb2_grpc

    from tests.e2e.cluster import prompts

    model, other = save_tiny_model(tmp_path / "v0"), save_tiny_model(tmp_path / "v1", seed=1)
    cluster = LocalCluster(model_dir=str(model), num_workers=2, policy="rhymerl", chunk_tokens=8,
                           log_dir=tmp_path / "logs", separate_redis=True,
                           extra_env={"RHYMERL_SCHEDULER_STEP_LOG_HOLD_S": "600"})  # never reached here
    params = SamplingParams(temperature=1.0, max_tokens=64, seed=3, ignore_eos=True)
    ps = prompts(6, offset=20)

    stream_ended = threading.Event()

    def restart_redis_once_a_write_failed() -> None:
        """(or once the step ended: then every sample was logged before the kill)"""
        while not stream_ended.wait(0.1) and not metric(
                cluster.scrape("scheduler"), 'rhymerl:step_log_writes_total{result="failed"}'):
            pass
        cluster.restart("redis")

    with cluster:
        seen, restarter = {}, threading.Thread(target=restart_redis_once_a_write_failed, daemon=True)
        with grpc.insecure_channel(cluster.scheduler_address) as channel:
            stub = rollout_pb2_grpc.RolloutServiceStub(channel)
            for event in stub.SubmitStep(_calls.step_request("outage", ps, 4, params, 0), timeout=300):
                for s in event_samples(event):
                    seen[(s.prompt_id, s.sample_index)] = (s.policy_version, list(s.token_ids))
                if seen and restarter.ident is None:  # the step's record is logged: Redis goes (once)
                    cluster.kill("redis")
                    restarter.start()
        stream_ended.set()
        restarter.join()
        assert len(seen) == 24
        cluster.kill("scheduler")
        cluster.restart("scheduler", wait=False)
        cluster.wait_registered(120)
        with RolloutClient(cluster.scheduler_address, timeout_s=120, max_retries=10) as client:
            assert client.load_weights(1, str(other)) == 1  # a push before the trainer re-submits
            again = client.rollout("outage", ps, n=4, sampling=params)
            assert client.stats().num_generated_tokens == 0  # nothing generated again
        assert {s.key: (s.policy_version, s.token_ids) for s in again.samples} == seen


def test_a_worker_that_exits_at_start_is_said_at_once_not_as_the_scheduler_not_ready(tmp_path):
    """The scheduler is ready only once a worker serves, so a worker that could not start
    (here: no checkpoint) kept `start` polling the scheduler until its deadline, which
    then said "scheduler not ready; see .../scheduler.log": the worker's one error line,
    in its own log, was never shown. `start` watches every process it started."""
    cluster = LocalCluster(model_dir=str(tmp_path / "no-model"), num_workers=1, log_dir=tmp_path / "logs")
    with pytest.raises(RuntimeError, match="worker-0 exited") as caught:
        cluster.start(timeout_s=240)
    cluster.stop()
    assert "Error: rhymerl worker could not start" in str(caught.value) and "no-model" in str(caught.value)
    assert all(proc.poll() is not None for proc in cluster.procs.values())


def test_a_worker_whose_drain_times_out_gives_its_sequences_back_without_a_traceback(tmp_path):
    """SIGTERM mid-step to a worker whose drain (0.3 s) ends before its sequences do: it
    ends its Link streams itself, so the scheduler runs what they held on the other worker
    (every sample once, none failed), and the worker exits 0 with no ERROR in its log
    (gRPC logged a traceback for each stream the server's stop cancelled)."""
    from tests.e2e.cluster import prompts

    model = save_tiny_model(tmp_path / "model")
    # 8 sequences at a time per worker: the step's 32 run in waves, so the first sample comes
    # back while the next wave runs
    cluster = LocalCluster(model_dir=str(model), num_workers=2, chunk_tokens=2048, log_dir=tmp_path / "logs",
                           extra_env={"RHYMERL_WORKER_MAX_NUM_SEQS": "8", "RHYMERL_WORKER_DRAIN_TIMEOUT_S": "60"},
                           worker_env={"worker-1": {"RHYMERL_WORKER_DRAIN_TIMEOUT_S": "0.3"}})  # (a worker's own wins)
    params = SamplingParams(temperature=1.0, max_tokens=300, seed=3, ignore_eos=True)
    with cluster, RolloutClient(cluster.scheduler_address, timeout_s=240) as client:
        environ = Path(f"/proc/{cluster.procs['worker-1'].pid}/environ").read_bytes().split(b"\0")
        assert b"RHYMERL_WORKER_DRAIN_TIMEOUT_S=0.3" in environ
        samples = []
        for sample in client.submit_step("drained", prompts(8, offset=30), n=4, sampling=params):
            samples.append(sample)
            if len(samples) == 1:  # the step's sequences are running on both workers
                cluster.procs["worker-1"].send_signal(signal.SIGTERM)
        assert cluster.procs["worker-1"].wait(60) == 0
        assert len(samples) == len({s.key for s in samples}) == 32
        assert not [s.error for s in samples if s.error]
        assert {len(s.token_ids) for s in samples} == {300}
    log = (tmp_path / "logs" / "worker-1.log").read_text()
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
