"""A worker whose KV cache holds fewer tokens than the model's maximum length registers
the cache's length: a step that cannot fit is INVALID_ARGUMENT at once, naming the field,
instead of being admitted, generated until its chunk outgrew the cache, then aborted."""

from __future__ import annotations

import grpc
import pytest
from rhymerl import Prompt, RolloutClient, SamplingParams
from rhymerl.v1 import worker_pb2, worker_pb2_grpc

from tests.e2e.cluster import TINY, Cluster, expect_status

pytestmark = pytest.mark.timeout(300)

KV_TOKENS = 4 * 16  # 4 blocks of 16 tokens, below the model's 512


@pytest.fixture(scope="module")
def small_kv_cluster(model_dir, redis_url):
    c = Cluster(model_dir=model_dir, redis_url=redis_url, num_workers=1, num_kv_blocks=KV_TOKENS // 16).start()
    yield c
    c.stop()


def test_the_worker_registers_the_length_its_kv_cache_holds(small_kv_cluster):
    assert TINY["max_position_embeddings"] > KV_TOKENS
    (_, address), = [(w.worker_id, w.address) for w in small_kv_cluster.scheduler.core.workers.workers.values()]
    with grpc.insecure_channel(address) as ch:
        stats = worker_pb2_grpc.WorkerServiceStub(ch).GetWorkerStats(worker_pb2.WorkerStatsRequest(), timeout=30)
    assert stats.max_model_len == KV_TOKENS


def test_a_step_longer_than_the_kv_cache_is_refused_naming_the_field_and_one_that_fits_runs(small_kv_cluster):
    with RolloutClient(small_kv_cluster.address, timeout_s=120, max_retries=0) as client:
        with pytest.raises(grpc.RpcError) as err:  # 20 + 60 tokens > 64: it once ran 40-odd tokens, then ABORT
            client.rollout("kv-long", [Prompt("p", [3] * 20)], n=1,
                           sampling=SamplingParams(max_tokens=60, ignore_eos=True, seed=1))
        expect_status(err.value, "INVALID_ARGUMENT", "sampling.max_tokens")
        result = client.rollout("kv-fits", [Prompt("p", [3] * 20)], n=2,
                                sampling=SamplingParams(max_tokens=KV_TOKENS - 20, ignore_eos=True, seed=1))
    assert [(len(s.token_ids), s.finish_reason) for s in result.samples] == [(KV_TOKENS - 20, "length")] * 2
