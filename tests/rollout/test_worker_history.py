"""A real worker (tiny model on CPU, compiled drafter) fed by a real history service
(real redis-server), spoken to over loopback gRPC: bad history written by an older
version, stored straight into Redis past PutRollouts' checks, costs drafts, never samples."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct

import grpc
import numpy as np
import pytest
import redis.asyncio as aioredis
from rhymerl.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from services.common.grpc_server import channel
from services.common.redis_server import free_port
from services.history.keys import HistoryKeys
from services.history.recent import RecentResponses, pack
from services.history.server import start_history
from services.history.settings import HistorySettings
from services.rollout.loader import init_random_model, save_model
from services.rollout.models.config import ModelConfig
from services.rollout.vllm_engine.smoke import TINY_VLLM
from tests.aio import run_async

pytestmark = pytest.mark.timeout(300)

# rhymerl's engine takes head_dim 16 (as tests/e2e/cluster.py's TINY)
TINY = {**TINY_VLLM, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16}
SAMPLING = common_pb2.SamplingParams(temperature=1.0, max_tokens=12, logprobs=True, ignore_eos=True, seed=5)
POISONED = [28, 12, -5, 99, 7]  # -5: what a PutRollouts without token checks once stored


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    save_model(init_random_model(ModelConfig(**TINY), 0), path)
    return path


async def write_old_entries(redis_url: str, keys: HistoryKeys) -> None:
    """What an older history service stored for prompt "poison1" in step "old0" (and in the
    recent-responses stream), written with Redis commands in the layout of keys.py."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        epoch = keys.epoch("poison1", "old0")
        await client.zadd(keys.epochs("poison1"), {"old0": 1})
        fields = {"version": "0", "lengths": b"".join(struct.pack("<ii", i, len(POISONED)) for i in range(3))}
        fields.update({f"tok:{i}": np.asarray(POISONED, "<i4").tobytes() for i in range(3)})
        await client.hset(epoch, mapping=fields)
        await RecentResponses(client, keys).push([pack("poison1", "old0", i, POISONED) for i in range(3)]
                                                 + [pack("clean", "old0", 0, [3, 4, 5, 6])])
    finally:
        await client.aclose()


@contextlib.asynccontextmanager
async def worker_with_history(model_dir, redis_url: str):
    from services.rollout.server import start_worker
    from services.rollout.settings import WorkerSettings

    _, history_port, stop_history = await start_history(
        HistorySettings(host="127.0.0.1", port=0, metrics_port=0, redis_url=redis_url))
    try:
        settings = WorkerSettings(host="127.0.0.1", port=free_port(), metrics_port=0, id="w-history",
                                  model_path=str(model_dir), device="cpu", dtype="float32", max_num_seqs=16,
                                  num_kv_blocks=64, block_size=16, speculative=True, drafter="compiled",
                                  measure_cost=False, scheduler_address="",
                                  history_address=f"127.0.0.1:{history_port}", drain_timeout_s=2)
        _, port, stop_worker = await start_worker(settings)
        try:
            yield f"127.0.0.1:{port}"
        finally:
            await stop_worker()
    finally:
        await stop_history()


def item(request_id: str, prompt_id: str, sample_index: int) -> worker_pb2.WorkItem:
    return worker_pb2.WorkItem(request_id=request_id, prompt_id=prompt_id, sample_index=sample_index,
                               prompt_token_ids=[3, 5, 7, 9], sampling=SAMPLING, max_new_tokens=12,
                               step_id="new1", num_samples=2)


@run_async
async def test_a_prompt_whose_stored_history_is_bad_still_decodes(model_dir, clean_redis, caplog):
    """Breaks if a history entry the drafter refuses (a negative token id, as stored before
    PutRollouts checked them) fails the Link stream: every sample of the batch, the clean
    prompts' too, would come back aborted on every step with that prompt."""
    await write_old_entries(clean_redis, HistoryKeys())
    caplog.set_level(logging.WARNING)
    async with worker_with_history(model_dir, clean_redis) as address, channel(address) as chan:
        stub = worker_pb2_grpc.WorkerServiceStub(chan)
        items = [item(f"r{k}-{i}", prompt, i) for k, prompt in enumerate(("poison1", "clean")) for i in range(2)]
        outbox: asyncio.Queue = asyncio.Queue()
        outbox.put_nowait(worker_pb2.LinkRequest(items=items))

        async def requests():
            while (batch := await outbox.get()) is not None:
                yield batch

        stream = stub.Link(requests(), timeout=120)
        results = {}
        try:
            async for response in stream:
                for r in response.results:
                    results[r.request_id] = r
                if len(results) == len(items):
                    break
        except grpc.aio.AioRpcError as err:  # the old worker: INTERNAL ... ValueError: responses: token id -5
            pytest.fail(f"the Link stream failed: {err.code()}: {err.details()}")
        finally:
            outbox.put_nowait(None)
            stream.cancel()
    assert sorted(results) == sorted(it.request_id for it in items)
    for r in results.values():
        assert not r.error and r.refusal == worker_pb2.REFUSAL_NONE, r
        assert r.finish_reason == common_pb2.FINISH_REASON_LENGTH and r.num_tokens == 12, r
    warnings = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert len([w for w in warnings if "prompt 'poison1'" in w]) == 1, warnings  # its 3 responses skipped
    assert len([w for w in warnings if "global draft index" in w]) == 1, warnings  # the stream's 3 skipped
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR], caplog.text
