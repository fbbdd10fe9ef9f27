"""The pushed bytes of the serving version, on the scheduler's disk, for workers that
come back (restarted, rescheduled) after the push: the fleet catches them up by itself.

A push is streamed through to the workers (``weight_fanout.py``) and, as it passes, into
a file of this store; never into the scheduler's memory beyond the few chunks in
flight. Once the push made its version serving the file is kept under its SHA-256 and
every other one is deleted: the store holds one model (two during a push). A worker
that returns on an older version gets the file streamed to it in ``CHUNK_BYTES``
pieces, as an ordinary ``PushWeights`` that it checks like any push (size, SHA-256,
finite tensors). A version loaded from a path needs no copy: the worker reads the path.

The directory (``RHYMERL_SCHEDULER_WEIGHTS_DIR``) may outlive the scheduler process (a
volume of the pod): a restarted scheduler finds the recorded version's file by its
SHA-256 (``serving.py``'s record) and catches workers up with it as before. Without a
directory, a private temporary one lives as long as the process.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from rhymerl.v1 import common_pb2

from services.common.errors import SettingError

log = logging.getLogger(__name__)
CHUNK_BYTES = 4 * 1024 * 1024  # what a catch-up streams per message (the SDK's push chunk)
SUFFIX = ".safetensors"


class WeightStore:
    def __init__(self, directory: str = ""):
        """Raises SettingError (setting ``weights_dir``) when the directory cannot be made
        or used: the service does not start."""
        self._private = not directory
        try:
            self.dir = Path(directory or tempfile.mkdtemp(prefix="rhymerl-weights-"))
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(".incoming-*"):  # a push the previous process did not finish
                stale.unlink(missing_ok=True)
            probe = tempfile.NamedTemporaryFile(dir=self.dir, prefix=".incoming-probe-")  # a push must be writable
            probe.close()
        except OSError as exc:
            raise SettingError("weights_dir", f"weights_dir {directory!r} is not a writable directory: "
                                              f"{exc.strerror or exc}") from None

    def path(self, sha256: str) -> Path | None:
        """The file of the payload with this SHA-256, if the store has it."""
        p = self.dir / (sha256 + SUFFIX)
        return p if sha256 and p.is_file() else None

    def writer(self, header: common_pb2.WeightHeader) -> "Incoming":
        return Incoming(self, header)

    def keep_only(self, sha256: str) -> None:
        """Deletes every payload but ``sha256``'s (a new version serves)."""
        for p in self.dir.glob("*" + SUFFIX):
            if p.name != sha256 + SUFFIX:
                p.unlink(missing_ok=True)

    def close(self) -> None:
        if self._private:
            shutil.rmtree(self.dir, ignore_errors=True)

    async def stream(self, version: int, sha256: str) -> AsyncIterator[common_pb2.WeightChunk]:
        """The stored payload as a push: a header, then chunks read one at a time (the
        file stays readable while a newer push replaces it: it is open)."""
        p = self.path(sha256)
        if p is None:
            raise FileNotFoundError(f"no stored payload with SHA-256 {sha256}")
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            yield common_pb2.WeightChunk(header=common_pb2.WeightHeader(version=version, total_bytes=size,
                                                                        sha256=sha256))
            while data := await asyncio.to_thread(f.read, CHUNK_BYTES):
                yield common_pb2.WeightChunk(data=data)


class Incoming:
    """A push being written to the store as it streams through; kept by ``commit`` only
    when complete and matching its header, dropped otherwise."""

    def __init__(self, store: WeightStore, header: common_pb2.WeightHeader):
        self.store, self.header = store, header
        self.sha256 = header.sha256.lower()
        fd, name = tempfile.mkstemp(prefix=".incoming-", dir=store.dir)
        self._file, self._name = os.fdopen(fd, "wb"), name
        self._digest, self.size = hashlib.sha256(), 0

    async def write(self, data: bytes) -> None:
        self._digest.update(data)
        self.size += len(data)
        await asyncio.to_thread(self._file.write, data)

    def commit(self) -> bool:
        """Keeps the payload under its SHA-256; False (and nothing kept) when it is not
        the one its header announced."""
        self._file.close()
        if self.size != self.header.total_bytes or self._digest.hexdigest() != self.sha256:
            self.discard()
            return False
        os.replace(self._name, self.store.dir / (self.sha256 + SUFFIX))
        return True

    def discard(self) -> None:
        self._file.close()
        Path(self._name).unlink(missing_ok=True)
