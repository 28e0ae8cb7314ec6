"""The engine-core gRPC server: bidi `Connect` streams <-> queues <-> the busy loop.

Each `Connect` is one connection: a reader task converts inputs and submits them to
the busy loop; the busy-loop thread hands outputs to a per-connection asyncio.Queue
(via `call_soon_threadsafe`) that the handler yields from. When the client goes
away (cancel, end of its input stream, an error) the connection closes and the
busy loop aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from tandem.v1 import engine_core_pb2, engine_core_pb2_grpc

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from services.engine import convert
from services.engine.busy_loop import EngineBusyLoop
from services.engine.health import ENGINE_CORE_SERVICE, EngineHealth
from services.engine.messages import EngineDied

logger = logging.getLogger(__name__)

_INPUT_ENDED = object()  # the reader's last item on a connection's queue


class EngineCoreServicer(engine_core_pb2_grpc.EngineCoreServicer):
    def __init__(self, busy_loop: EngineBusyLoop, info: engine_core_pb2.EngineInfo) -> None:
        self.busy_loop = busy_loop
        self.info = info

    async def GetEngineInfo(self, request, context) -> engine_core_pb2.EngineInfo:
        return self.info

    async def Connect(self, request_iterator, context):
        if self.busy_loop.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.busy_loop.error)
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue = asyncio.Queue()

        def sink(item) -> None:  # called from the busy-loop thread
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                loop.call_soon_threadsafe(outbox.put_nowait, item)

        connection = self.busy_loop.open(sink)
        reader = asyncio.create_task(self._read(connection, request_iterator, outbox))
        logger.debug("connection %d opened by %s", connection, context.peer())
        try:
            while True:
                item = await outbox.get()
                if item is _INPUT_ENDED:
                    return
                if isinstance(item, EngineDied):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, item.error)
                yield convert.outputs_to_proto(item)
        finally:
            reader.cancel()
            self.busy_loop.close(connection)
            logger.debug("connection %d closed", connection)

    async def _read(self, connection: int, request_iterator, outbox: asyncio.Queue) -> None:
        """Inputs -> the busy loop; inputs that do not convert are refused on this connection."""
        try:
            async for message in request_iterator:
                try:
                    item = convert.input_from_proto(message)
                except ValueError as exc:
                    outbox.put_nowait(convert.refusal(message, str(exc)))
                    continue
                self.busy_loop.submit(connection, item)
        except Exception as exc:  # noqa: BLE001 - a broken input stream just ends the connection
            logger.debug("connection %d input failed: %s", connection, exc)
        finally:
            outbox.put_nowait(_INPUT_ENDED)


class EngineServer:
    """An EngineCore behind `tandem.v1.EngineCore`, health and reflection on one address.

    The engine loads in the constructor (so a bad config fails before anything listens);
    `start()` binds (port 0 picks a free port) and returns the port.
    """

    def __init__(self, config: EngineConfig, address: str = "127.0.0.1:50061", *, stall_timeout: float = 30.0) -> None:
        self.config = config
        self.address = address
        self.engine = EngineCore(config)
        self.busy_loop = EngineBusyLoop(self.engine)
        self.health = EngineHealth(self.busy_loop, stall_timeout)
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> int:
        self.server = grpc.aio.server()
        info = convert.engine_info_to_proto(self.engine.info, self.config)
        engine_core_pb2_grpc.add_EngineCoreServicer_to_server(EngineCoreServicer(self.busy_loop, info), self.server)
        self.health.add_to_server(self.server)
        services = (ENGINE_CORE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, self.server)
        self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise RuntimeError(f"could not listen on {self.address}")
        self.busy_loop.start()
        await self.server.start()
        await self.health.start()
        logger.info("engine core serving %s on port %d", self.engine.info.model_path, self.port)
        return self.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Health NOT_SERVING, then stop the server (in-flight streams get `grace` seconds), then the loop."""
        await self.health.shutdown()
        if self.server is not None:
            await self.server.stop(grace)
        await asyncio.to_thread(self.busy_loop.stop)

    async def wait_for_termination(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()
