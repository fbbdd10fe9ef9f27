"""grpc_errors: a call to another service that failed UNAVAILABLE or DEADLINE_EXCEEDED is
UNAVAILABLE to the caller (clients retry it) with one WARNING line; any other failure of
such a call stays INTERNAL with its traceback logged (a bug of ours, or theirs)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from services.common.errors import grpc_errors


class Aborted(Exception):
    pass


class Context:
    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted


def downstream(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Servicer:
    def __init__(self, exc):
        self.exc = exc

    @grpc_errors
    async def Unary(self, request, context):
        raise self.exc

    @grpc_errors
    async def Streaming(self, request, context):
        yield 1
        raise self.exc


async def statuses(exc) -> list[tuple[grpc.StatusCode, str]]:
    out = []
    for call in ("unary", "stream"):
        context = Context()
        with pytest.raises(Aborted):
            if call == "unary":
                await Servicer(exc).Unary(None, context)
            else:
                async for _ in Servicer(exc).Streaming(None, context):
                    pass
        out.append((context.code, context.details))
    return out


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_downstream_service_down_is_unavailable_with_a_warning_not_a_traceback(code, caplog):
    caplog.set_level(logging.INFO, logger="services.common.errors")
    for status, details in asyncio.run(statuses(downstream(code, "failed to connect to all addresses"))):
        assert status == grpc.StatusCode.UNAVAILABLE
        assert code.name in details and "failed to connect to all addresses" in details and "unavailable" in details
    assert caplog.records and all(r.levelno == logging.WARNING and not r.exc_info for r in caplog.records)


def test_other_downstream_failures_stay_internal_with_the_traceback_logged(caplog):
    caplog.set_level(logging.INFO, logger="services.common.errors")
    for status, _ in asyncio.run(statuses(downstream(grpc.StatusCode.INVALID_ARGUMENT, "bad"))):
        assert status == grpc.StatusCode.INTERNAL
    assert caplog.records and all(r.levelno == logging.ERROR and r.exc_info for r in caplog.records)
