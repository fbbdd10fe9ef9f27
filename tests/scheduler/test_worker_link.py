"""What a Run call's status means for its samples."""

from __future__ import annotations

import grpc

from services.scheduler.worker_link import RunOutcome, outcome


def test_only_the_workers_own_failures_count_against_the_samples():
    code = grpc.StatusCode
    assert outcome(code.INTERNAL, "internal error in WorkerServicer.Run: RuntimeError: boom") \
        is RunOutcome.ENGINE_FAILED
    # A worker killed mid-stream: the transport's words, not the samples' fault.
    assert outcome(code.UNKNOWN, "Stream removed") is RunOutcome.LOST
    assert outcome(code.INTERNAL, "Received RST_STREAM with error code 2") is RunOutcome.LOST
    assert outcome(code.UNAVAILABLE, "Socket closed") is RunOutcome.LOST
    assert outcome(code.INVALID_ARGUMENT, "items[0].sampling.top_p: must be in [0, 1]") is RunOutcome.REJECTED
    assert outcome(code.FAILED_PRECONDITION, "policy_version: ...") is RunOutcome.WRONG_VERSION
