"""Building, health-checking and gracefully stopping an asyncio gRPC server."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common.errors import BindError
from services.common.malformed import MalformedRequests
from services.common.security import TLSConfig

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A peer that restarted (a killed pod) is reconnected within a second or two: gRPC's
    # default backoff grows to 120 s, and every call fails fast until it expires.
    # Not grpc.min_reconnect_backoff_ms: gRPC core uses it as the connect timeout
    # (MIN_CONNECT_TIMEOUT of doc/connection-backoff.md, grpc/grpc#12830), so 200 ms there
    # failed every connect that took longer, as connects do under load (a 1,024-worker
    # fleet flapped unhealthy; docs/architecture.md). Its default, 20 s, bounds a connect
    # to an unreachable peer; a refused one fails at once and is retried after the backoff.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Servers accept the clients' keepalive pings above: gRPC's default (one per 5 minutes
# without data) answers them with GOAWAY "too_many_pings", dropping idle-then-busy
# connections (a worker's Run stream among them).
# Not grpc.so_reuseport (on by default in gRPC's Python server): with it a second process
# started on a port in use binds it too and the kernel splits the connections between the
# two (a second history service with a store of its own, a second worker). Off, it fails.
NO_PORT_SHARING = [("grpc.so_reuseport", 0)]
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.http2.min_ping_interval_without_data_ms", 10_000), *NO_PORT_SHARING]
NOT_BOUND = "in use, or not this machine's address"  # why a bind failed: gRPC's error names no cause


class Server:
    """An aio server with the standard health service (grpc.health.v1).

    Args:
        servicers: pairs of (``add_XServicer_to_server`` function, servicer).
        service_names: full names reported SERVING by the health service.
        tls: serve TLS when it holds a certificate; plaintext otherwise.
        interceptors: e.g. ``BearerTokenAuth`` (requests that do not parse are always
            answered INVALID_ARGUMENT naming the field, after these).
        health_port: with TLS, also serve the health service alone in plaintext on this
            port (0: no), for Kubernetes gRPC probes, which cannot speak TLS.
    """

    def __init__(self, servicers: Iterable[tuple[Callable, object]], service_names: Iterable[str],
                 tls: TLSConfig | None = None, interceptors: Iterable[grpc.aio.ServerInterceptor] = (),
                 health_port: int = 0):
        self.server = grpc.aio.server(options=SERVER_OPTIONS,
                                      interceptors=[*interceptors, MalformedRequests()])
        self.credentials = tls.server_credentials() if tls is not None else None
        for add, servicer in servicers:
            add(servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = ["", *service_names]
        # more places the statuses are published to (``set(name, serving)``): a health
        # process serving them off this server's event loop (``health_process.py``)
        self.mirrors: list = []
        self.port = 0
        self.health_port = health_port
        self.health_server: grpc.aio.Server | None = None
        if self.credentials is not None and health_port:
            self.health_server = grpc.aio.server(options=NO_PORT_SHARING)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)

    async def start(self, host: str, port: int) -> int:
        address = f"{host}:{port}"
        try:
            self.port = (self.server.add_secure_port(address, self.credentials) if self.credentials
                         else self.server.add_insecure_port(address))
        except RuntimeError:  # gRPC's "Failed to bind", which names no cause
            self.port = 0
        if self.port == 0:
            raise BindError("gRPC port", address, NOT_BOUND, "port")
        if self.health_server is not None:
            try:
                self.health_port = self.health_server.add_insecure_port(f"{host}:{self.health_port}")
            except RuntimeError:
                raise BindError("health port", f"{host}:{self.health_port}", NOT_BOUND, "health_port") from None
            await self.health_server.start()
        await self.server.start()
        await self.set_serving(True)
        return self.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.service_names:
            await self.health.set(name, status)
            for mirror in self.mirrors:
                mirror.set(name, serving)

    async def set_service_serving(self, name: str, serving: bool) -> None:
        """Readiness of one service (the process itself, "", stays as it is)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set(name, status)
        for mirror in self.mirrors:
            mirror.set(name, serving)

    async def stop(self, grace: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)


_up = False  # this process's service has started (it reached run_until_signal)


def service_up() -> bool:
    """Whether this process's service got as far as serving: a failure before that is
    a start-up failure (the command line says it in one line, settings_cli.py)."""
    return _up


async def run_until_signal(stop: Callable[[], Awaitable[None]]) -> None:
    """Waits for SIGTERM or SIGINT, then awaits ``stop`` (drain, deregister, close)."""
    global _up
    _up = True
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    log.info("shutting down")
    await stop()


def channel(address: str, tls: TLSConfig | None = None) -> grpc.aio.Channel:
    """A channel to another rhymerl service: TLS when ``tls`` names a CA."""
    credentials = tls.channel_credentials() if tls is not None else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=CHANNEL_OPTIONS + tls.channel_options())


def _message_or_bytes(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def raw_responses(add: Callable, methods: Iterable[str]) -> Callable:
    """``add`` (a generated ``add_XServicer_to_server``) whose ``methods`` may also answer
    with messages already serialized (bytes, sent as they are): a service that keeps its
    answers serialized does not parse them again to send them."""
    methods = frozenset(methods)

    def raw(method: str, handler):
        return handler._replace(response_serializer=_message_or_bytes) if method in methods else handler

    class Generic(grpc.GenericRpcHandler):  # a generated generic handler, its answers' serializers replaced
        def __init__(self, inner):
            self.inner = inner

        def service(self, details):
            handler = self.inner.service(details)
            return None if handler is None else raw(details.method.rsplit("/", 1)[-1], handler)

    def add_raw(servicer, server) -> None:
        # Takes what the generated code registers, with the serializers replaced. Code from
        # grpcio-tools >= 1.62 registers both kinds; older code (as the GPU bundle may carry)
        # only the generic handler, so each kind is passed on by itself.
        class Registrar:
            def add_generic_rpc_handlers(self, handlers) -> None:
                server.add_generic_rpc_handlers(tuple(Generic(h) for h in handlers))

            def add_registered_method_handlers(self, name, handlers) -> None:
                server.add_registered_method_handlers(name, {m: raw(m, h) for m, h in handlers.items()})

        add(servicer, Registrar())
    return add_raw
