"""A HistoryService that takes every call and never answers: a hung history (a SIGSTOPped
process, a deadlocked server) as its clients see it, over real gRPC on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter

import grpc
from rhymerl.v1 import history_pb2_grpc


class HangingHistory(history_pb2_grpc.HistoryServiceServicer):
    """Counts the calls it received (by method); answers none of them."""

    def __init__(self):
        self.calls: Counter[str] = Counter()

    async def _hang(self, method: str):
        self.calls[method] += 1
        await asyncio.Event().wait()  # until the client's deadline or cancel ends the call

    async def PutRollouts(self, request, context):
        return await self._hang("PutRollouts")

    async def PutRewards(self, request, context):
        return await self._hang("PutRewards")

    async def GetHistory(self, request, context):
        return await self._hang("GetHistory")

    async def GetRecentResponses(self, request, context):
        return await self._hang("GetRecentResponses")


@contextlib.asynccontextmanager
async def hanging_history():
    """Yields (address, servicer) of a hanging HistoryService on a free loopback port."""
    server = grpc.aio.server()
    servicer = HangingHistory()
    history_pb2_grpc.add_HistoryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        await server.stop(0)
