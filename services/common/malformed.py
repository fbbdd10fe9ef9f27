"""Requests that do not parse get INVALID_ARGUMENT naming the field, not UNKNOWN with the
parser's exception.

Protobuf refuses a string field whose bytes are not UTF-8 while deserializing, before
any servicer runs. A server interceptor wraps every method's deserializer: a request
that fails to parse becomes a ``Malformed`` marker, and the method answers it with
INVALID_ARGUMENT whose message starts with the offending field's path
(``prompts[1].prompt_id: ...``), found by walking the wire format against the
message's descriptor.
"""

from __future__ import annotations

import inspect

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError


class Malformed:
    """Stands in for a request that did not parse; ``message`` says where and why."""

    def __init__(self, message: str):
        self.message = message


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def _is_repeated(field: FieldDescriptor) -> bool:
    if hasattr(field, "is_repeated"):  # protobuf >= 5.29 (``label`` is gone in 7)
        return field.is_repeated
    return field.label == FieldDescriptor.LABEL_REPEATED


def bad_utf8_field(data: bytes, descriptor: Descriptor, prefix: str = "") -> str | None:
    """The path of the first string field in ``data`` that is not UTF-8, or None."""
    pos, seen = 0, {}
    try:
        while pos < len(data):
            tag, pos = _varint(data, pos)
            number, wire_type = tag >> 3, tag & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
                continue
            if wire_type in (1, 5):
                pos += 8 if wire_type == 1 else 4
                continue
            if wire_type != 2:
                return None
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            index = seen[number] = seen.get(number, -1) + 1
            path = prefix + field.name + (f"[{index}]" if _is_repeated(field) else "")
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    value.decode("utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = bad_utf8_field(value, field.message_type, path + ".")
                if found:
                    return found
    except ValueError:
        return None
    return None


def _safe(deserialize):
    message_type = getattr(deserialize, "__self__", None)
    descriptor = getattr(message_type, "DESCRIPTOR", None)

    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as exc:
            field = bad_utf8_field(data, descriptor) if descriptor is not None else None
            return Malformed(f"{field}: is not valid UTF-8" if field else f"request does not parse: {exc}")
    return parse


async def _checked(requests, context):
    async for request in requests:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    kwargs = dict(request_deserializer=_safe(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
    if handler.unary_unary:
        async def unary_unary(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            return await handler.unary_unary(request, context)
        return grpc.unary_unary_rpc_method_handler(unary_unary, **kwargs)
    if handler.unary_stream:
        async def unary_stream(request, context):
            if isinstance(request, Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            responses = handler.unary_stream(request, context)
            if inspect.isawaitable(responses):  # it answers with context.write (grpc_health's aio Watch)
                await responses
                return
            async for response in responses:
                yield response
        return grpc.unary_stream_rpc_method_handler(unary_stream, **kwargs)
    if handler.stream_unary:
        async def stream_unary(requests, context):
            return await handler.stream_unary(_checked(requests, context), context)
        return grpc.stream_unary_rpc_method_handler(stream_unary, **kwargs)

    async def stream_stream(requests, context):
        async for response in handler.stream_stream(_checked(requests, context), context):
            yield response
    return grpc.stream_stream_rpc_method_handler(stream_stream, **kwargs)


class MalformedRequests(grpc.aio.ServerInterceptor):
    """Answers requests that do not parse with INVALID_ARGUMENT naming the field."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _wrap(handler)
