"""Receiving new weights on a worker: a checked stream or a path, applied between samples.

The payload is complete and verified (size, SHA-256, finite values, tensor names and
shapes) before the engine sees any of it; only then is it copied into the model, while
the engine is idle. Anything short of that leaves the current version serving.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from rhymerl.v1 import common_pb2

from services.common.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound

MAX_WEIGHT_BYTES = 1 << 40  # the largest payload a worker takes (and the scheduler forwards)
# A safetensors header's most bytes (the format's own reference reader refuses larger ones).
MAX_HEADER_BYTES = 100 * 1024 * 1024


def max_push_bytes(model) -> int:
    """The largest payload that can hold ``model``'s weights: each tensor it expects at 8
    bytes per value (float64, the widest dtype a push may use), plus one more of its
    largest tensor (a tied lm_head some checkpoints store), plus a header. A push is
    buffered whole before it is checked, so a larger one (a wrong file, optimizer state)
    is refused at its header (the rest read and dropped) instead of growing the worker
    towards an OOM. A model that names no tensors (another engine's): MAX_WEIGHT_BYTES."""
    expected = getattr(model, "expected_weights", None)
    if expected is None:
        return MAX_WEIGHT_BYTES
    numels = [t.numel() for t in expected().values()] or [0]
    return min(MAX_WEIGHT_BYTES, 8 * (sum(numels) + max(numels)) + MAX_HEADER_BYTES)


@dataclass(frozen=True)
class Payload:
    version: int
    sha256: str
    data: bytes | bytearray


async def receive(chunks: AsyncIterator[common_pb2.WeightChunk], max_bytes: int) -> Payload:
    """Reads a header and the data chunks; raises a precise error for a bad stream.

    The checksum is computed chunk by chunk as they arrive, and the payload is not copied
    at the end: hashing a whole model (538 MB for SmolLM2) in one go blocked the worker's
    event loop for seconds under load, long enough for the scheduler's health poll to time
    out and mark the worker unhealthy in the middle of the push (docs/smollm2.md).

    A push refused before its end has the rest read and dropped (nothing kept) before the
    refusal: a call its server ends while the sender still streams may reach the sender as
    gRPC's INTERNAL "Internal error from Core", not this status (the scheduler then answered
    the trainer UNAVAILABLE, which the SDK retries)."""
    try:
        return await _receive(chunks, max_bytes)
    except InvalidArgument:
        async for _ in chunks:
            pass
        raise


async def _receive(chunks: AsyncIterator[common_pb2.WeightChunk], max_bytes: int) -> Payload:
    first = await anext(aiter(chunks), None)
    if first is None or not first.HasField("header"):
        raise InvalidArgument("the first message must be a header", "header")
    header = first.header
    if header.total_bytes <= 0 or header.total_bytes > max_bytes:
        raise InvalidArgument(f"must be in [1, {max_bytes}], got {header.total_bytes}", "header.total_bytes")
    if len(header.sha256) != 64:
        raise InvalidArgument("must be a hex SHA-256 (64 characters)", "header.sha256")
    buf, digest = bytearray(), hashlib.sha256()
    async for chunk in chunks:
        if chunk.HasField("header"):
            raise InvalidArgument("only the first message may be a header", "header")
        buf += chunk.data
        digest.update(chunk.data)
        if len(buf) > header.total_bytes:
            raise InvalidArgument(f"more than total_bytes ({header.total_bytes}) received", "data")
    if len(buf) != header.total_bytes:
        raise DataLoss(f"push of version {header.version} interrupted: {len(buf)} of {header.total_bytes} bytes "
                       "arrived; the previous version keeps serving")
    if digest.hexdigest() != header.sha256.lower():
        raise DataLoss(f"checksum mismatch for version {header.version} (got {digest.hexdigest()}); "
                       "the previous version keeps serving", "header.sha256")
    return Payload(header.version, digest.hexdigest(), buf)


def check_finite(state: dict) -> dict:
    """Returns ``state`` if every floating-point tensor is finite: NaN or Inf weights make
    every later sample token 0 with NaN logprobs, so they never reach the engine."""
    import torch

    for name, tensor in state.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise InvalidArgument(f"tensor {name!r} is not finite (it holds NaN or Inf)", "data")
    return state


def check_version(new: int, current: int, new_sha: str = "", current_sha: str = "") -> bool:
    """True when the update must be applied, False when it is a re-send of the current one."""
    if new == current and new_sha and new_sha == current_sha:
        return False
    if new <= current:
        raise FailedPrecondition(f"must be greater than the version serving ({current}), got {new}", "version")
    return True


def checkpoint_sha256(path: str) -> str:
    """SHA-256 of the checkpoint a worker started from when it is one .safetensors file
    (the bytes a trainer re-pushing that version sends); "" when it is not (several
    files, a hub name): such a re-push cannot be recognised."""
    try:
        [file] = safetensors_files(path)
    except (NotFound, ValueError):
        return ""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def safetensors_files(path: str) -> list[Path]:
    """The .safetensors files of a checkpoint directory, or the single file given. A path
    the system refuses to look at (too long, no permission) is NOT_FOUND naming it too:
    its OSError was an INTERNAL error, which the scheduler answered UNAVAILABLE (retry)."""
    p = Path(path)
    try:
        if p.is_file() and p.suffix == ".safetensors":
            return [p]
        if p.is_dir():
            files = sorted(p.glob("*.safetensors"))
            if files:
                return files
            raise NotFound(f"no .safetensors file in {path}", "path")
    except OSError as exc:
        shown = path if len(path) <= 200 else f"{path[:200]}... ({len(path)} characters)"
        raise NotFound(f"{shown} cannot be read: {exc.strerror or exc}", "path") from None
    raise NotFound(f"{path} does not exist or is not a .safetensors file / checkpoint directory", "path")
