"""grpc.health.v1 served by a process of its own, off a busy service's event loop.

A scheduler in the middle of a 65,536-sample step lags its event loop by seconds, and a
health check answered by that loop waits as long: the kubelet's readiness probe (1 s
timeout) would take the scheduler out of its Service mid-step, and its liveness probe
could restart it. So the health service answers from a small child process
(``python -m services.common.health_process``) with a plain gRPC server of its own,
on a port of its own, and never waits for the service's loop:

- The service (``HealthProcess``, in its loop) writes one line to the child's stdin
  whenever a status changes, and again every ``tick_s``: every service's status, in
  the order the child was given the names. Each line is the whole state (a write the
  pipe could not take at once is dropped; the next tick repairs it) and a sign that
  the loop turns. A write is a few bytes to a non-blocking pipe: nothing for the loop.
- The child answers Check and Watch from the last line it read. When no line came for
  ``stall_s`` (the loop is stuck, or the process stopped), it answers NOT_SERVING for
  every name, "" (liveness) included, until lines come again: a hung service is
  restarted by its liveness probe as before, while seconds of lag are not a failure.
- The service's death closes the pipe: the child reports NOT_SERVING and exits, so
  nothing answers for a dead process. A child that died is started again by the
  service at its next tick, unless the service is stopping.
- The child ignores SIGINT and SIGTERM: Ctrl-C, or a SIGTERM to the whole process group
  (``kill -TERM -PGID``, a process supervisor), reaches the service too, which drains
  with its health still answered (NOT_SERVING) and then closes the pipe. A child that
  died of either signal anyway (one sent before it could ignore them) is not restarted
  and is no error: its service is being stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

SERVING, NOT_SERVING = 1, 2  # grpc.health.v1 HealthCheckResponse.ServingStatus
BIND_WAIT_S = 10.0  # a restarted service's port may still be held by its previous child for a moment
START_TIMEOUT_S = 60.0


class HealthProcess:
    """The service's side: starts the child, publishes statuses, restarts a dead child.

    Args:
        host, port: where the child serves (plaintext; 0 picks a free port).
        services: the names it answers for ("" is the process: liveness).
        stall_s: the child reports NOT_SERVING once no line came this long; 0: never.
        tick_s: how often the state is re-sent (the loop's sign of life).
    """

    def __init__(self, host: str, port: int, services: Sequence[str], stall_s: float, tick_s: float = 1.0,
                 bind_wait_s: float = BIND_WAIT_S, setting: str = "health_port"):
        self.host, self.port, self.stall_s, self.tick_s = host, port, stall_s, tick_s
        self.bind_wait_s, self.setting = bind_wait_s, setting  # setting: what names the port (services/cli.py)
        self.names = list(services)
        self.status = dict.fromkeys(self.names, NOT_SERVING)
        self.proc: subprocess.Popen | None = None
        self._ticker: asyncio.Task | None = None
        self._stopping = False

    async def start(self) -> int:
        """Starts the child; returns the port it serves on (``BindError`` when the port is
        taken, RuntimeError when the child fails otherwise)."""
        argv = [sys.executable, "-m", "services.common.health_process", "--host", self.host,
                "--port", str(self.port), "--stall-s", str(self.stall_s), "--bind-wait-s", str(self.bind_wait_s),
                "--", *[n or "-" for n in self.names]]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            line = b""
        if not line.startswith(b"ready "):
            proc.kill()
            proc.wait()
            self._close_pipes(proc)
            if line.startswith(b"unbound "):  # the child could not bind the port: one line says it
                from services.common.errors import BindError

                raise BindError("health port", f"{self.host}:{self.port}", line.decode().split(" ", 1)[1].strip(),
                                self.setting)
            raise RuntimeError(f"the health process could not serve on {self.host}:{self.port} "
                               f"(exit status {proc.returncode}; its error is in this process's log)")
        os.set_blocking(proc.stdin.fileno(), False)
        self.proc, self.port = proc, int(line.split()[1])
        self._publish()
        if self._ticker is None:
            self._ticker = asyncio.create_task(self._tick())
        log.info("health served off the event loop on %s:%d (process %d)", self.host, self.port, proc.pid)
        return self.port

    def set(self, name: str, serving: bool) -> None:
        status = SERVING if serving else NOT_SERVING
        if self.status.get(name) != status:
            self.status[name] = status
            self._publish()

    def _publish(self) -> None:
        if self.proc is None:
            return
        line = " ".join(str(self.status[n]) for n in self.names).encode() + b"\n"
        try:
            os.write(self.proc.stdin.fileno(), line)  # far below PIPE_BUF: written whole or not at all
        except (BlockingIOError, BrokenPipeError, OSError):
            pass  # the child is behind (the next tick repairs it) or gone (the ticker restarts it)

    def stopping(self) -> None:
        """The service has begun to stop: a child that dies from now on is not restarted
        (the group's SIGTERM may reach it first) and the statuses keep being published."""
        self._stopping = True

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            if self.proc is not None and self.proc.poll() is None:
                self._publish()
                continue
            if self.proc is not None:  # it died (None: a restart failed, tried again now)
                status = self.proc.returncode
                self._close_pipes(self.proc)
                self.proc = None
                if self._stopping or status in (-signal.SIGTERM, -signal.SIGINT):
                    log.info("the health process exited (%s) as the service stops; not starting it again",
                             _exit_status(status))
                    return
                log.error("the health process exited (%s); starting it again", _exit_status(status))
            elif self._stopping:
                return
            try:
                await self.start()
            except RuntimeError as exc:
                log.error("%s; trying again", exc)

    async def stop(self) -> None:
        self._stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        self._close_pipes(proc)  # EOF: the child answers NOT_SERVING and exits
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), 10)
        except asyncio.TimeoutError:
            proc.kill()
            await asyncio.to_thread(proc.wait)

    @staticmethod
    def _close_pipes(proc: subprocess.Popen) -> None:
        for pipe in (proc.stdin, proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _exit_status(returncode: int) -> str:
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            pass
    return f"status {returncode}"


# --- the child ------------------------------------------------------------------------

def _in_use(host: str, port: int) -> bool:
    """Whether another socket listens on host:port, asked with a plain socket: gRPC's
    own failed bind logs an error line per attempt, and a port held for BIND_WAIT_S
    would fill the service's log with them. gRPC's bind still decides."""
    if not port:
        return False
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listeners: TIME_WAIT is no owner
            probe.bind(address)
    except OSError as exc:
        return exc.errno == errno.EADDRINUSE
    return False


def _bind(host: str, port: int, wait_s: float = BIND_WAIT_S):
    """A started gRPC server with a health servicer on host:port, waiting up to
    ``wait_s`` for a port a previous child still holds (SO_REUSEPORT off: two children
    must never share a port and split the probes between them)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    deadline = time.monotonic() + wait_s
    said = False
    while True:
        bound, taken = 0, _in_use(host, port)
        if not taken:
            servicer = health.HealthServicer()
            # Spelt out, not grpc_server.NO_PORT_SHARING: importing grpc_server loads
            # pydantic and protobuf's message modules, a third of a second and some MB more
            # for a process meant to import little besides grpc.
            server = grpc.server(ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
            health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
            try:
                bound = server.add_insecure_port(f"{host}:{port}")
            except RuntimeError:
                bound = 0
        if bound:
            server.start()
            return server, servicer, bound
        if time.monotonic() > deadline:
            raise RuntimeError("in use by another process" if taken else "in use, or not this machine's address")
        if not said and wait_s > 0:
            print(f"health: {host}:{port} is in use; waiting up to {wait_s:g} s for it (a previous health process "
                  "may still hold it)", file=sys.stderr, flush=True)
            said = True
        time.sleep(0.2)


def _follow(fd: int, names: list[str], apply, stall_s: float) -> None:
    """Applies every status line read from ``fd`` until EOF; NOT_SERVING for all while
    none came for ``stall_s``."""
    buffer, last, stalled, current = b"", time.monotonic(), False, [NOT_SERVING] * len(names)
    while True:
        wait = None if not stall_s or stalled else max(0.0, last + stall_s - time.monotonic())
        readable, _, _ = select.select([fd], [], [], wait)
        if not readable:
            if not stalled:
                print(f"health: no word from the service for {stall_s:.0f} s: reporting NOT_SERVING",
                      file=sys.stderr, flush=True)
                stalled = True
                apply([NOT_SERVING] * len(names))
            continue
        data = os.read(fd, 4096)
        if not data:
            return
        *lines, buffer = (buffer + data).split(b"\n")
        for line in lines:
            parts = line.split()
            if len(parts) == len(names) and all(p in (b"1", b"2") for p in parts):
                current = [int(p) for p in parts]
        if stalled:
            print("health: the service answers again", file=sys.stderr, flush=True)
        last, stalled = time.monotonic(), False
        apply(current)


def _tell(line: str) -> None:
    """A line to the service on stdout. A service that stopped while this process started
    has closed the pipe: this one then ends too (SystemExit(0), no BrokenPipeError
    traceback in the service's log)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        raise SystemExit(0) from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="grpc.health.v1 for a service whose statuses come on stdin")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stall-s", type=float, default=0.0)
    parser.add_argument("--bind-wait-s", type=float, default=BIND_WAIT_S)
    parser.add_argument("names", nargs="+", help="service names; - is the server itself (\"\")")
    args = parser.parse_args(argv)
    names = ["" if n == "-" else n for n in args.names]
    try:
        server, servicer, port = _bind(args.host, args.port, args.bind_wait_s)
    except RuntimeError as exc:
        _tell(f"unbound {exc}")  # the service says it, naming the setting (services/cli.py)
        return 1
    from grpc_health.v1 import health_pb2

    applied: dict[str, int] = {}

    def apply(statuses: list[int]) -> None:
        """Sets what changed (a Watch is answered on a change, not on every line)."""
        for name, status in zip(names, statuses):
            if applied.get(name) != status:
                applied[name] = status
                servicer.set(name, health_pb2.HealthCheckResponse.SERVING if status == SERVING
                             else health_pb2.HealthCheckResponse.NOT_SERVING)

    apply([NOT_SERVING] * len(names))
    try:
        _tell(f"ready {port}")
        _follow(sys.stdin.fileno(), names, apply, args.stall_s)
    finally:
        apply([NOT_SERVING] * len(names))
        servicer.enter_graceful_shutdown()
        server.stop(0.5).wait()
    return 0


if __name__ == "__main__":
    # Its life is the pipe's: it ends when the service does (which drains first on
    # SIGINT/SIGTERM, with its health answered). Ignored before main imports grpc.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(main())
