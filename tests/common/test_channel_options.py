"""The services' channels connect to a peer that is slow to answer, as peers are under
load. ``grpc.min_reconnect_backoff_ms`` is gRPC core's connect timeout (grpc/grpc#12830):
at 200 ms, every connect whose handshake took longer failed, and a busy scheduler marked
a 1,024-worker fleet unhealthy over and over (docs/architecture.md)."""

from __future__ import annotations

import asyncio

from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_server import Server, channel
from tests.aio import run_async

HANDSHAKE_DELAY_S = 1.0  # well past the 200 ms the old option allowed


async def _slow_proxy(target_port: int) -> tuple[asyncio.AbstractServer, int]:
    """A TCP proxy that holds the server's first bytes (its HTTP/2 settings) for
    HANDSHAKE_DELAY_S on every new connection, then forwards both ways."""

    async def pipe(reader, writer, delay_s: float) -> None:
        try:
            first = True
            while data := await reader.read(65536):
                if first:
                    await asyncio.sleep(delay_s)
                    first = False
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def handle(client_reader, client_writer) -> None:
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", target_port)
        await asyncio.gather(pipe(client_reader, server_writer, 0.0),
                             pipe(server_reader, client_writer, HANDSHAKE_DELAY_S))

    proxy = await asyncio.start_server(handle, "127.0.0.1", 0)
    return proxy, proxy.sockets[0].getsockname()[1]


@run_async
async def test_a_connect_slower_than_200ms_succeeds():
    server = Server([], [])
    port = await server.start("127.0.0.1", 0)
    proxy, proxy_port = await _slow_proxy(port)
    ch = channel(f"127.0.0.1:{proxy_port}")
    try:
        # not wait_for_ready (the scheduler's calls are not): a failed connect fails the call
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await ch.close()
        proxy.close()
        await server.stop(0)
