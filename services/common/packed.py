"""Token payloads as the bytes that go on the wire, so the scheduler moves them without
decoding them (worker.proto: ChunkResult.packed_token_ids / packed_logprobs).

Token ids travel as the payload of a packed ``repeated int32`` field (protobuf varints,
without the field's key and length); logprobs as the payload of a packed ``repeated
float`` (float32 little-endian). Payloads of one kind concatenate, and a payload put
behind a field's key and length (``field``) is that field, so the scheduler builds a
WorkItem's ``generated_token_ids`` and a SampleResult's ``token_ids`` / ``logprobs`` by
splicing the chunks' bytes. Encoding and decoding happen on the workers and in the
trainer's protobuf parser; the scheduler only checks a payload's framing (``check``).
"""

from __future__ import annotations

import re
import sys
from array import array

from rhymerl.v1 import worker_pb2

_CONTINUATION = bytes(range(0x80, 0x100))
# One varint: up to nine continuation bytes, then a final byte (protobuf's at most 10).
_VARINTS = re.compile(rb"(?:[\x80-\xff]{0,9}[\x00-\x7f])*")
_LITTLE = sys.byteorder == "little"


_ONE_BYTE = [bytes((i,)) for i in range(0x80)]  # the varints of 0..127
_KEYS = [bytes((number << 3 | 2,)) for number in range(16)]  # length-delimited keys of fields 1-15
_M = 0x7F


def varint(n: int) -> bytes:
    """A non-negative integer as a protobuf varint. The common sizes take no loop: one and
    two bytes (ids, lengths, counts) and nine (a 63-bit seed, ``ids.sample_seed``)."""
    if n < 0x80:
        return _ONE_BYTE[n]
    if n < 0x4000:
        return bytes((n & _M | 0x80, n >> 7))
    if 1 << 56 <= n < 1 << 63:
        return bytes((n & _M | 0x80, n >> 7 & _M | 0x80, n >> 14 & _M | 0x80, n >> 21 & _M | 0x80,
                      n >> 28 & _M | 0x80, n >> 35 & _M | 0x80, n >> 42 & _M | 0x80, n >> 49 & _M | 0x80, n >> 56))
    out = bytearray()
    while n >= 0x80:
        out.append((n & _M) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def read_varint(data: bytes) -> int:
    """The integer of a protobuf varint (``varint``'s inverse; ValueError if it does not end)."""
    n = shift = 0
    for byte in data:
        n |= (byte & _M) << shift
        if byte < 0x80:
            return n
        shift += 7
    raise ValueError(f"{data!r}: not a whole varint")


def field(number: int, payload: bytes) -> bytes:
    """``payload`` as a length-delimited field (a packed repeated field, a string, a
    message); empty for an empty payload (proto3 omits an empty field)."""
    if not payload:
        return b""
    return b"".join((_KEYS[number] if number < 16 else varint(number << 3 | 2), varint(len(payload)), payload))


def header(number: int, size: int) -> bytes:
    """The key and length of a length-delimited field of ``size`` bytes (what ``field``
    puts before its payload)."""
    return (_KEYS[number] if number < 16 else varint(number << 3 | 2)) + varint(size)


def payload(encoded: bytes) -> bytes:
    """A length-delimited field's payload (``field``'s inverse for field numbers 1-15:
    a one-byte key)."""
    i = 1  # a one-byte key
    while encoded[i] & 0x80:
        i += 1
    return encoded[i + 1:]


def pack_token_ids(token_ids) -> bytes:
    """Token ids (each in int32) -> the payload of a packed repeated int32."""
    if not len(token_ids):
        return b""
    return payload(worker_pb2.TokenIds(ids=token_ids).SerializeToString())


def unpack_token_ids(payload: bytes) -> list[int]:
    """The inverse of ``pack_token_ids`` (ValueError on a malformed payload)."""
    if not payload:
        return []
    try:
        return list(worker_pb2.TokenIds.FromString(field(1, payload)).ids)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, named here
        raise ValueError(f"not a packed int32 payload: {exc}") from exc


def pack_logprobs(logprobs) -> bytes:
    """Floats -> float32 little-endian bytes."""
    a = array("f", logprobs)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_logprobs(payload: bytes) -> list[float]:
    if len(payload) % 4:
        raise ValueError(f"{len(payload)} bytes of logprobs: not a multiple of 4")
    a = array("f", payload)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def count_varints(payload: bytes) -> int:
    """How many varints a well-framed payload holds (its final bytes)."""
    return len(payload.translate(None, _CONTINUATION))


def check(packed_token_ids: bytes, num_tokens: int, packed_logprobs: bytes) -> str:
    """What is wrong with a chunk's payloads ("" when nothing): the framing only (whole
    varints of at most 10 bytes, ``num_tokens`` of them, one float32 logprob per token or
    none), in C-speed passes over the bytes; the values are the worker's."""
    if num_tokens < 0:
        return f"num_tokens: {num_tokens} is negative"
    if _VARINTS.fullmatch(packed_token_ids) is None:
        return "packed_token_ids: not a sequence of whole protobuf varints"
    found = count_varints(packed_token_ids)
    if found != num_tokens:
        return f"packed_token_ids: {found} token ids, but num_tokens is {num_tokens}"
    if packed_logprobs and len(packed_logprobs) != 4 * num_tokens:
        return f"packed_logprobs: {len(packed_logprobs)} bytes for {num_tokens} tokens (4 per token, or none)"
    return ""
