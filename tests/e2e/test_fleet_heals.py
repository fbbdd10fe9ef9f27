"""Workers that restart after a weight push are brought to the serving version by the
fleet itself, whether the version came as pushed bytes or a path: real processes
(``LocalCluster``), kill -9, no trainer action."""

from __future__ import annotations

import threading

import pytest
from rhymerl import RolloutClient, SamplingParams

from services.local import LocalCluster
from tests.e2e.cluster import prompts, save_tiny_model, wait_until
from tests.e2e.test_weight_pushes import weights

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]
PARAMS = SamplingParams(temperature=1.0, max_tokens=96, seed=5, ignore_eos=True)
PROMPTS = prompts(4, offset=60)


def tokens(samples) -> dict:
    return {s.key: list(s.token_ids) for s in samples}


@pytest.mark.parametrize("how", ["pushed bytes"])  # "path" works the same way (a slow test: not run twice)
def test_restarted_workers_are_caught_up_to_the_pushed_version(tmp_path, how):
    model = save_tiny_model(tmp_path / "model")
    new_weights = weights(seed=1)
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "model.safetensors").write_bytes(new_weights)
    cluster = LocalCluster(model_dir=str(model), num_workers=2, policy="rhymerl", chunk_tokens=8,
                           log_dir=tmp_path / "logs", extra_env={"RHYMERL_SCHEDULER_WORKER_TIMEOUT_S": "90"})
    with cluster, RolloutClient(cluster.scheduler_address, timeout_s=300) as client:
        if how == "path":
            assert client.load_weights(1, str(tmp_path / "v1")) == 1
        else:
            assert client.push_weights(1, new_weights) == 1
        reference = tokens(client.rollout("quiet", PROMPTS, n=4, sampling=PARAMS).samples)

        # 1. Every worker killed mid-step and restarted: they come back on their initial
        # weights (version 0), and the running step must still end, at version 1.
        box = {}
        step = threading.Thread(target=lambda: box.update(r=client.rollout("killed", PROMPTS, n=4,
                                                                              sampling=PARAMS)), daemon=True)
        step.start()
        wait_until(lambda: any(w.num_running for w in client.stats().workers), 120, "the step never ran")
        for w in cluster.workers:
            cluster.kill(w)
        for w in cluster.workers:
            cluster.restart(w, wait=False)
        step.join(300)
        assert not step.is_alive(), "the step hung"
        samples = box["r"].samples
        assert len(samples) == 16 and {s.policy_version for s in samples} == {1}
        assert tokens(samples) == reference  # no ABORT: the same tokens as the quiet run

        # 2. One worker restarted: it rejoins at version 1 and gets work again.
        cluster.kill("worker-1")
        wait_until(lambda: not any(w.worker_id == "worker-1" and w.healthy for w in client.stats().workers), 120,
                   "the scheduler never noticed the kill")
        cluster.restart("worker-1", wait=False)
        wait_until(lambda: any(w.worker_id == "worker-1" and w.healthy and w.policy_version == 1
                               for w in client.stats().workers), 120, "worker-1 never caught up")
        short = SamplingParams(temperature=1.0, max_tokens=16, seed=5, ignore_eos=True)
        again = client.rollout("after", prompts(24, offset=70), n=4, sampling=short)  # more than one worker holds
        assert {s.policy_version for s in again.samples} == {1}
        wait_until(lambda: _scrapes(cluster, "worker-1"), 60, "worker-1 serves no /metrics")
        generated = [line for line in cluster.scrape("worker-1").splitlines()
                     if line.startswith("rhymerl:generation_tokens_total")]
        assert generated and float(generated[0].rsplit(" ", 1)[1]) > 0, "the returning worker got no work"


def _scrapes(cluster: LocalCluster, name: str) -> bool:
    try:
        return "rhymerl:generation_tokens_total" in cluster.scrape(name)
    except OSError:  # its metrics server starts a moment after it registers
        return False
