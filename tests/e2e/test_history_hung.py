"""A hung history (its process SIGSTOPped: the kernel still accepts connections, nothing
answers) costs a step a bounded delay, not the 30 s client deadline per history call it
used to (a step took 110 s, the next 20 s): the scheduler and the worker wait at most
their history deadline, then skip history until it answers again. The samples are the
ones a healthy history gives (history only speeds drafting and placement up)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from rhymerl import RolloutClient, SamplingParams

from services.local import LocalCluster
from tests.e2e.cluster import prompts, save_tiny_model

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
BOUND_S = 20.0  # a hung step: 1 s deadlines plus a tiny-model step; generous for a busy 2-core machine


def test_a_sigstopped_history_costs_steps_a_bounded_delay_and_is_used_again_once_it_answers(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    cluster = LocalCluster(model_dir=str(model), num_workers=1, policy="rhymerl", chunk_tokens=8,
                           log_dir=tmp_path / "logs",
                           extra_env={"RHYMERL_SCHEDULER_HISTORY_TIMEOUT_S": "1",
                                      "RHYMERL_WORKER_HISTORY_TIMEOUT_S": "1",
                                      # the same tokens bit for bit, with drafts from history or without
                                      "RHYMERL_WORKER_BATCH_INVARIANT": "1"})
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=5)
    ps = prompts(3, offset=40)
    tokens = lambda result: {s.key: s.token_ids for s in result.samples}  # noqa: E731
    with cluster, RolloutClient(cluster.scheduler_address, timeout_s=120) as client:
        healthy = client.rollout("healthy", ps, n=2, sampling=params)
        history = cluster.procs["history"]
        os.kill(history.pid, signal.SIGSTOP)
        try:
            for i in range(3):
                started = time.monotonic()
                hung = client.rollout(f"hung-{i}", ps, n=2, sampling=params)
                took = time.monotonic() - started
                assert took < BOUND_S, f"step {i} took {took:.1f} s with history hung"
                assert tokens(hung) == tokens(healthy) and len(hung.samples) == 6
                assert hung.summary.history_hit_rate == 0.0
        finally:
            os.kill(history.pid, signal.SIGCONT)
        # History answers again: the scheduler's next lookup (after its backoff, or at once
        # once a write behind a closed step landed) finds the prompts' earlier epochs.
        deadline, found = time.monotonic() + 120, None
        while time.monotonic() < deadline:
            back = client.rollout(f"back-{int(time.monotonic() * 1000)}", ps, n=2, sampling=params)
            assert tokens(back) == tokens(healthy)
            if back.summary.history_hit_rate == 1.0:
                found = back
                break
            time.sleep(1.0)
        assert found is not None, "history was never used again after it answered"
    scheduler_log = (tmp_path / "logs" / "scheduler.log").read_text()
    worker_log = (tmp_path / "logs" / "worker-0.log").read_text()
    for log in (scheduler_log, worker_log):  # one WARNING for the outage, not one per call
        assert sum("WARNING" in line and "history" in line and "failed" in line
                   for line in log.splitlines()) == 1, log[-3000:]
    assert "history answers again" in scheduler_log
    assert "no answer within 1 s" in worker_log  # RHYMERL_WORKER_HISTORY_TIMEOUT_S
