"""The serving version's record in Redis outlives the step log's TTL: a deployment that
goes longer than RHYMERL_SCHEDULER_STEP_LOG_TTL_S (24 h by default) without a push, then
loses its scheduler and a worker (a node drain, a helm upgrade), still catches the worker
up to the pushed version, and the restarted scheduler exports that version
(rhymerl:weight_version). Real processes (``LocalCluster``), kill -9, a short TTL so the
step log expires during the test; every wait is on a state, bounded."""

from __future__ import annotations


import pytest
import redis
from rhymerl import RolloutClient, SamplingParams

from services.local import LocalCluster
from services.scheduler.step_log import step_key
from tests.e2e.cluster import prompts, save_tiny_model, wait_until
from tests.e2e.test_weight_pushes import weights

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]
PARAMS = SamplingParams(temperature=1.0, max_tokens=16, seed=5, ignore_eos=True)


def test_a_worker_restarted_after_the_step_logs_ttl_is_still_caught_up(tmp_path):
    model = save_tiny_model(tmp_path / "model")
    cluster = LocalCluster(model_dir=str(model), num_workers=2, log_dir=tmp_path / "logs", separate_redis=True,
                           extra_env={"RHYMERL_SCHEDULER_STEP_LOG_TTL_S": "1"})
    with cluster, RolloutClient(cluster.scheduler_address, timeout_s=300) as client:
        assert client.push_weights(1, weights(seed=1)) == 1
        client.rollout("pushed", prompts(2), n=2, sampling=PARAMS)
        store = redis.Redis.from_url(cluster.redis_url)
        # the step log's TTL has passed once the step's own log is gone
        wait_until(lambda: not store.exists(step_key("pushed")), 120, "the step log never expired")
        assert store.hget("rhymerl:serving", "version") == b"1", "the serving version's record expired"

        cluster.kill("scheduler")
        cluster.kill("worker-0")
        cluster.restart("scheduler", wait=False)
        cluster.restart("worker-0", wait=False)  # on its initial checkpoint: version 0
        wait_until(lambda: {(w.worker_id, w.healthy, w.policy_version) for w in client.stats().workers}
                   == {("worker-0", True, 1), ("worker-1", True, 1)}, 180,
                   "the restarted worker was never caught up to version 1")
        # and the restarted scheduler exports the version it restored (the dashboard's "Policy
        # version" had no data after a restart until the next push)
        assert 'rhymerl:weight_version{component="scheduler"} 1.0' in cluster.scrape("scheduler").splitlines()
        after = client.rollout("after", prompts(8, offset=10), n=2, sampling=PARAMS)
        assert {s.policy_version for s in after.samples} == {1}
        store.close()
