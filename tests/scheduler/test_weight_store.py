"""The scheduler's weight store: a push is written to disk as it streams through, kept
only when complete and as announced, and streamed back in bounded chunks for a worker
that returns after the push."""

from __future__ import annotations

import hashlib

import pytest
from rhymerl.v1 import common_pb2

from services.scheduler import weight_store
from services.scheduler.weight_store import WeightStore
from tests.aio import run_async


def header(data: bytes, version: int = 3, sha256: str | None = None) -> common_pb2.WeightHeader:
    return common_pb2.WeightHeader(version=version, total_bytes=len(data),
                                   sha256=sha256 or hashlib.sha256(data).hexdigest())


async def write(store: WeightStore, data: bytes, **kw):
    incoming = store.writer(header(data, **kw))
    for i in range(0, len(data), 1000):
        await incoming.write(data[i:i + 1000])
    return incoming


@run_async
async def test_a_complete_push_is_kept_and_streamed_back_in_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(weight_store, "CHUNK_BYTES", 4096)
    store = WeightStore(str(tmp_path))
    data = bytes(range(256)) * 100  # 25,600 bytes: 7 chunks of at most 4,096
    incoming = await write(store, data)
    assert store.path(incoming.sha256) is None  # not before it is complete and committed
    assert incoming.commit()
    messages = [m async for m in store.stream(3, incoming.sha256)]
    assert messages[0].header == header(data)
    assert b"".join(m.data for m in messages[1:]) == data
    assert max(len(m.data) for m in messages[1:]) <= 4096 and len(messages) == 8
    older = incoming.sha256
    newer = await write(store, b"other weights", version=4)
    assert newer.commit()
    store.keep_only(newer.sha256)  # a new version serves: one model on disk
    assert store.path(older) is None and store.path(newer.sha256) is not None
    assert sorted(p.name for p in tmp_path.iterdir()) == [newer.sha256 + ".safetensors"]


@run_async
async def test_a_short_or_corrupt_push_leaves_nothing(tmp_path):
    store = WeightStore(str(tmp_path))
    corrupt = await write(store, b"x" * 5000, sha256="0" * 64)
    assert not corrupt.commit()
    short = store.writer(header(b"y" * 5000))
    await short.write(b"y" * 10)
    short.discard()  # the trainer's stream broke
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileNotFoundError):
        [m async for m in store.stream(3, "0" * 64)]


def test_a_private_store_goes_with_the_process_and_a_shared_one_drops_unfinished_writes(tmp_path):
    private = WeightStore()
    assert private.dir.is_dir()
    private.close()
    assert not private.dir.exists()
    (tmp_path / ".incoming-abc").write_bytes(b"half a push")
    (tmp_path / ("a" * 64 + ".safetensors")).write_bytes(b"kept")
    shared = WeightStore(str(tmp_path))  # a restarted scheduler on the same volume
    assert [p.name for p in tmp_path.iterdir()] == ["a" * 64 + ".safetensors"]
    shared.close()
    assert shared.path("a" * 64) is not None  # not private: it outlives the process


@run_async
async def test_a_record_unreadable_at_start_is_read_later_and_lagging_workers_caught_up():
    """A scheduler restarted while Redis was down learns the version from its workers,
    with no source to catch a restarted worker up from; once Redis answers, the record
    gives it (the fault campaign's 120 s without a worker, e00c193)."""
    from services.scheduler.step_log import RecordUnreadable
    from services.scheduler.weight_fanout import WeightFanout
    from tests.scheduler.fake_workers import FakeLink, make_core

    link = FakeLink()
    core = make_core(link, workers=0)
    answers = [RecordUnreadable("Redis down"), RecordUnreadable("still down"), (3, "", "/ckpt/v3")]

    async def load_serving():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    core.log.load_serving = load_serving
    fanout = WeightFanout(core)
    await fanout.restore()
    core.register("w0", "fake:0", 4, 3, 96, 512)  # the version is learned from the fleet
    assert core.policy_version == 3
    back = core.register("w1", "fake:1", 4, 0, 96, 512)  # restarted on its initial weights
    await fanout.catch_up(back)
    assert link.loads == []  # no source: nothing to catch up from
    await fanout.reread_record()  # Redis still down
    await fanout.reread_record()
    await fanout.catch_up(back)
    assert link.loads == [("w1", 3, "/ckpt/v3")] and back.policy_version == 3
    await fanout.reread_record()  # read once: not asked again
    assert answers == []
    await core.stop()
