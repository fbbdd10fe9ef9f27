"""A real worker's Link stream, spoken to directly over gRPC (as the scheduler does, its
WorkItems spliced by the scheduler's own encoder): refusals per item while the stream
goes on, packed payloads that decode to the tokens the worker generated, and a resumed
chunk whose spliced generated tokens the worker reads."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
from rhymerl.v1 import common_pb2, worker_pb2

from services.common import packed
from services.scheduler.policies.base import RequestKey
from services.scheduler.worker_link import LINK_METHOD, Chunk, encode_batch, prompt_field, step_fields

pytestmark = pytest.mark.timeout(300)
SAMPLING = common_pb2.SamplingParams(temperature=1.0, max_tokens=12, logprobs=True, ignore_eos=True)


def chunk(dispatch_id: str, prompt: list[int], generated: list[int] = (), max_new_tokens: int = 12) -> Chunk:
    return Chunk(dispatch_id, RequestKey("link-test", "p", 0), prompt_field("p", prompt),
                 packed.pack_token_ids(list(generated)), len(generated), SAMPLING, packed.varint(77), max_new_tokens,
                 step_fields(SAMPLING, "link-test", 1))


class Link:
    """A Link stream to one worker, driven from the test's thread."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.outbox: queue.Queue = queue.Queue()
        method = self.channel.stream_stream(LINK_METHOD, request_serializer=bytes,
                                            response_deserializer=worker_pb2.LinkResponse.FromString)
        self.responses = method(iter(self.outbox.get, None), timeout=120)
        self.results: dict[str, worker_pb2.ChunkResult] = {}
        self.lock = threading.Lock()

    def send(self, policy_version: int, chunks: list[Chunk]) -> None:
        self.outbox.put(encode_batch(policy_version, chunks))

    def wait(self, *dispatch_ids: str) -> list[worker_pb2.ChunkResult]:
        while not all(d in self.results for d in dispatch_ids):
            for result in next(self.responses).results:
                self.results[result.request_id] = result
        return [self.results[d] for d in dispatch_ids]

    def close(self) -> None:
        self.outbox.put(None)
        self.channel.close()


def test_refusals_per_item_payloads_and_a_resumed_chunk_over_one_stream(cluster):
    worker = cluster.scheduler.core.workers.workers["w0"]
    link = Link(worker.address)
    prompt = [3, 5, 7, 9]
    try:
        link.send(0, [chunk("whole", prompt), chunk("bad", [3, 10**6])])
        whole, bad = link.wait("whole", "bad")
        assert bad.refusal == worker_pb2.REFUSAL_INVALID_ARGUMENT and "items[1].prompt_token_ids" in bad.error
        assert not whole.error and whole.refusal == worker_pb2.REFUSAL_NONE and whole.num_tokens == 12
        tokens = packed.unpack_token_ids(whole.packed_token_ids)
        logprobs = packed.unpack_logprobs(whole.packed_logprobs)
        assert len(tokens) == len(logprobs) == 12 and all(lp <= 0 for lp in logprobs)

        link.send(worker.policy_version + 1, [chunk("other-version", prompt)])  # the stream goes on after it
        (refused,) = link.wait("other-version")
        assert refused.refusal == worker_pb2.REFUSAL_WRONG_VERSION and "policy_version" in refused.error

        link.send(0, [chunk("first", prompt, max_new_tokens=5)])
        (first,) = link.wait("first")
        assert first.num_tokens == 5 and first.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
        # The next chunk carries the first one's bytes as they came: the worker counts them as
        # generated (7 more reach max_tokens: LENGTH) and, batch-invariant or not, starts from them.
        link.send(0, [Chunk("rest", RequestKey("link-test", "p", 0), prompt_field("p", prompt),
                            first.packed_token_ids, 5, SAMPLING, packed.varint(77), 7, step_fields(SAMPLING, "link-test", 1))])
        (rest,) = link.wait("rest")
        assert rest.num_tokens == 7 and rest.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(packed.unpack_token_ids(first.packed_token_ids + rest.packed_token_ids)) == 12
        # a resumed chunk that claims more generated tokens than max_tokens allows is refused, naming the field
        link.send(0, [Chunk("over", RequestKey("link-test", "p", 0), prompt_field("p", prompt),
                            whole.packed_token_ids, 12, SAMPLING, packed.varint(77), 1, step_fields(SAMPLING, "link-test", 1))])
        (over,) = link.wait("over")
        assert over.refusal == worker_pb2.REFUSAL_INVALID_ARGUMENT and "items[0].max_new_tokens" in over.error
    finally:
        link.close()
