"""Precise exceptions inside; gRPC status codes at the edge, in one place.

Servicer methods are wrapped with :func:`grpc_errors`: a :class:`RhymerlError`
becomes its status code and message (which names the offending field); a call to
another service that failed UNAVAILABLE or DEADLINE_EXCEEDED (it is down, or did not
answer in time) becomes UNAVAILABLE, which clients retry, with a one-line warning;
any other exception becomes INTERNAL with a one-line message while the traceback
goes to the log. A client never sees a stack trace.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

log = logging.getLogger(__name__)


class RhymerlError(Exception):
    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, field: str | None = None):
        self.field = field
        super().__init__(f"{field}: {message}" if field else message)


class InvalidArgument(RhymerlError, ValueError):
    """Also a ValueError: the engine, used as a library, raises it for bad requests."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(RhymerlError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(RhymerlError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(RhymerlError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(RhymerlError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(RhymerlError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(RhymerlError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DataLoss(RhymerlError):
    code = grpc.StatusCode.DATA_LOSS


class SettingError(RuntimeError):
    """A setting's value that the service cannot start with (a directory it cannot create, a
    file it cannot open, a required value left empty). ``setting`` is the settings field:
    the command line names its option and environment variable (services/cli.py)."""

    def __init__(self, setting: str, message: str):
        self.setting = setting
        super().__init__(message)


class BindError(RuntimeError):
    """A port a service was told to serve on could not be bound (another process serves
    on it, or it is privileged). ``setting`` is the settings field that names the port
    ("port", "metrics_port", "health_port"): the command line says which option and
    environment variable to change (services/cli.py)."""

    def __init__(self, what: str, address: str, reason: str, setting: str):
        self.address, self.setting = address, setting
        super().__init__(f"could not bind the {what} {address}: {reason}")


# What a downstream call's status says about the service it called, not about the request.
DOWNSTREAM_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, RhymerlError):
        return exc.code, str(exc)
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)) \
            and exc.code() in DOWNSTREAM_UNAVAILABLE:  # (an AioRpcError, or a sync call's error)
        message = (f"{method}: a service it calls is unavailable ({exc.code().name}: {exc.details()}); "
                   "retry").splitlines()[0]
        log.warning("%s", message)
        return grpc.StatusCode.UNAVAILABLE, message
    log.exception("unexpected error in %s", method)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}".splitlines()[0]


def grpc_errors(method):
    """Maps exceptions raised by an asyncio servicer method to gRPC statuses.

    Works for unary (``async def``) and server-streaming (``async def`` with
    ``yield``) methods; ``context`` is the method's last positional argument.
    """
    name = method.__qualname__
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status, never leaked
                await context.abort(*_status_of(exc, name))
        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await context.abort(*_status_of(exc, name))
    return unary_wrapper
