"""One engine address as the gRPC engine client holds it: channel, current stream, requests in flight, load.

`GrpcEngineClient` owns one per address its discovery reports. The connection knows which engine
requests are in flight on it (with the prefix hashes routed along with each, which the router
counts as expected there until the request ends), what the engine last reported about its load,
and whether it is retiring: gone from discovery, taking no new requests, closed once empty.
"""

from __future__ import annotations

import asyncio

from tandem.v1 import engine_core_pb2_grpc

from engine_core.protocol import EngineInfo, EngineState, KVCacheEvents, SchedulerStats
from engine_core.protocol.block_hash import BlockHash
from services.frontend.engines.router import EngineLoad
from services.security.transport import ChannelTransport


class EngineConnection:
    def __init__(self, address: str, transport: ChannelTransport) -> None:
        self.address = address
        self.channel = transport.aio_channel(address)
        self.stub = engine_core_pb2_grpc.EngineCoreServiceStub(self.channel)
        self.info: EngineInfo | None = None
        self.queue: asyncio.Queue | None = None  # inputs for the current stream; None: not connected
        self.in_flight: dict[str, list[BlockHash]] = {}  # the client's only record: request id -> routed hashes
        self.pending: dict[int, asyncio.Future] = {}  # utility call id -> result
        self.task: asyncio.Task | None = None
        self.retiring = False  # gone from discovery: no new requests; closed once nothing is in flight
        self.load = EngineLoad()  # the router's view
        self.state = EngineState()  # paused or asleep, as the engine last said on the current stream

    @property
    def connected(self) -> bool:
        return self.queue is not None

    @property
    def routable(self) -> bool:
        return self.connected and not self.retiring

    @property
    def admitting(self) -> bool:
        """New requests sent here start now (not held by a pause, not refused by sleep)."""
        return self.routable and self.state.admitting

    @property
    def idle(self) -> bool:
        return not self.in_flight and not self.pending

    def send(self, message) -> None:
        self.queue.put_nowait(message)

    # ---- the stream's life ---------------------------------------------------------
    def opened(self, queue: asyncio.Queue, info: EngineInfo) -> None:
        self.queue, self.info = queue, info
        self.load.block_size = info.block_size

    def closed(self) -> list[str]:
        """The stream ended: its requests are lost (returned), the engine's cache is unknown until it reports again."""
        self.queue = None
        lost = self.untrack(list(self.in_flight))
        self.load = EngineLoad(block_size=self.load.block_size)
        self.state = EngineState()  # a new stream's first item says it again if it is not the default
        return lost

    # ---- requests ------------------------------------------------------------------
    def track(self, request_id: str, prefix_hashes: list[BlockHash]) -> None:
        self.in_flight[request_id] = prefix_hashes
        self.load.prefix.expect(prefix_hashes)
        self.load.in_flight = len(self.in_flight)

    def untrack(self, request_ids) -> list[str]:
        """Forget these requests (finished, aborted, refused or lost); those that were here."""
        gone = []
        for request_id in request_ids:
            hashes = self.in_flight.pop(request_id, None)
            if hashes is not None:
                self.load.prefix.unexpect(hashes)
                gone.append(request_id)
        self.load.in_flight = len(self.in_flight)
        return gone

    # ---- what the engine reports ---------------------------------------------------
    def observe(self, stats: SchedulerStats | None, kv_events: KVCacheEvents | None) -> None:
        if stats is not None:
            self.load.running, self.load.waiting = stats.num_running_reqs, stats.num_waiting_reqs
            self.load.kv_usage = stats.kv_cache_usage
        if kv_events is not None:
            self.load.prefix.apply(kv_events)

    async def close(self) -> None:
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.channel.close()
