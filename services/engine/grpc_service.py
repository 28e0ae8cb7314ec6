"""The engine core's gRPC side: bidi `Connect` streams <-> queues <-> a busy loop.

Each `Connect` is one connection: a reader task converts inputs and submits them to
the busy loop; the busy loop hands outputs to a per-connection bounded outbox that the
handler yields from. When the client goes away (cancel, end of its input stream, an
error) or stops reading until the outbox overflows (RESOURCE_EXHAUSTED), the connection
closes and the busy loop aborts its requests.

The busy loop is either this process's `EngineBusyLoop` (a server embedded in a test
process, `EngineServer`) or, in `tandem-engine`, the engine process's seen through the
socket between the two (`processes/socket_pair.RemoteBusyLoop`, from processes/server_process.py). Torch-free.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from tandem.v1 import engine_core_pb2, engine_core_pb2_grpc

from engine_core.protocol import EngineCoreOutputs, PauseCall, PauseMode, UtilityCall
from services.engine import convert
from services.engine.busy_loop_items import EngineDied
from services.engine.health import ENGINE_CORE_SERVICE, EngineHealth
from services.engine.outbox import DEFAULT_MAX_PENDING_OUTPUTS, ConnectionOutbox, Overflowed
from services.engine.processes.busy_loop_interface import BusyLoop
from services.security.transport import ENGINE_LINK_MAX_MESSAGE_BYTES, ServerTransport

logger = logging.getLogger(__name__)

_INPUT_ENDED = object()  # the reader's last item on a connection's queue


class EngineCoreServicer(engine_core_pb2_grpc.EngineCoreServiceServicer):
    def __init__(self, busy_loop: BusyLoop, info: engine_core_pb2.GetEngineInfoResponse,
                 max_pending_outputs: int = DEFAULT_MAX_PENDING_OUTPUTS) -> None:
        self.busy_loop = busy_loop
        self.info = info
        self.max_pending_outputs = max_pending_outputs

    async def GetEngineInfo(self, request, context) -> engine_core_pb2.GetEngineInfoResponse:
        if self.busy_loop.error is not None:  # a dead engine is not worth connecting to
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.busy_loop.error)
        return self.info

    async def Connect(self, request_iterator, context):
        if self.busy_loop.error is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self.busy_loop.error)
        outbox = ConnectionOutbox(self.max_pending_outputs, on_overflow=lambda: self.busy_loop.close(connection))
        connection = self.busy_loop.open(outbox.put_threadsafe)
        reader = asyncio.create_task(self._read(connection, request_iterator, outbox))
        logger.debug("connection %d opened by %s", connection, context.peer())
        try:
            while True:
                item = await outbox.get()
                if item is _INPUT_ENDED:
                    return
                if isinstance(item, EngineDied):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, item.error)
                if isinstance(item, Overflowed):
                    logger.warning("connection %d from %s closed: %s", connection, context.peer(), item.message)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, item.message)
                yield convert.outputs_to_proto(item)
        finally:
            reader.cancel()
            self.busy_loop.close(connection)
            logger.debug("connection %d closed", connection)

    async def _read(self, connection: int, request_iterator, outbox: ConnectionOutbox) -> None:
        """Inputs -> the busy loop; inputs that do not convert are refused on this connection."""
        try:
            async for message in request_iterator:
                try:
                    item = convert.input_from_proto(message)
                except ValueError as exc:
                    outbox.put(convert.refusal(message, str(exc)))
                    continue
                self.busy_loop.submit(connection, item)
        except Exception as exc:  # noqa: BLE001 - a broken input stream just ends the connection
            logger.debug("connection %d input failed: %s", connection, exc)
        finally:
            outbox.put_final(_INPUT_ENDED)


def drain(busy_loop: BusyLoop) -> asyncio.Future:
    """Stop admitting (adds are held) and resolve once nothing is in flight: a PAUSE WAIT on a connection
    of our own, answered by the busy loop when its last running request finishes (or at once if it died)."""
    loop = asyncio.get_running_loop()
    drained = loop.create_future()

    def resolve() -> None:
        if not drained.done():
            drained.set_result(None)

    def sink(item) -> None:  # from the busy loop's thread, or this loop's (RemoteBusyLoop)
        if isinstance(item, EngineDied) or (isinstance(item, EngineCoreOutputs) and item.utility_result):
            loop.call_soon_threadsafe(resolve)

    connection = busy_loop.open(sink)
    busy_loop.submit(connection, UtilityCall(call_id=0, call=PauseCall(PauseMode.WAIT)))
    drained.add_done_callback(lambda _: busy_loop.close(connection))
    return drained


class EngineGrpcServer:
    """`tandem.v1.EngineCoreService`, health and reflection on one address, over `busy_loop`.

    `start()` binds (port 0 picks a free port) and returns the port; `stop(grace)` drains and stops
    listening (the busy loop is its owner's to stop). `transport` sets TLS / mutual TLS and the
    message size limit.
    """

    def __init__(self, busy_loop: BusyLoop, info: engine_core_pb2.GetEngineInfoResponse, address: str, *,
                 stall_timeout: float = 30.0, max_pending_outputs: int = DEFAULT_MAX_PENDING_OUTPUTS,
                 transport: ServerTransport = ServerTransport(max_message_bytes=ENGINE_LINK_MAX_MESSAGE_BYTES)) -> None:
        if max_pending_outputs < 1:
            raise ValueError(f"max_pending_outputs must be >= 1, got {max_pending_outputs}")
        self.busy_loop = busy_loop
        self.info = info
        self.address = address
        self.transport = transport
        self.max_pending_outputs = max_pending_outputs
        self.health = EngineHealth(busy_loop, stall_timeout)
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> int:
        self.server = self.transport.server()
        servicer = EngineCoreServicer(self.busy_loop, self.info, self.max_pending_outputs)
        engine_core_pb2_grpc.add_EngineCoreServiceServicer_to_server(servicer, self.server)
        self.health.add_to_server(self.server)
        services = (ENGINE_CORE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, self.server)
        self.port = self.transport.add_port(self.server, self.address)
        if self.port == 0:
            raise RuntimeError(f"could not listen on {self.address}")
        await self.server.start()
        await self.health.start()
        return self.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Drain, then stop listening: new requests are held (not started) and health says NOT_SERVING;
        requests in flight get up to `grace` seconds to finish; then the streams close (held requests end
        UNAVAILABLE at their frontends, which retry elsewhere)."""
        drained = drain(self.busy_loop) if grace else None
        await self.health.shutdown()
        if drained is not None:
            try:
                await asyncio.wait_for(drained, grace)
            except asyncio.TimeoutError:
                logger.warning("requests still in flight after the %.1f s grace period are cut off", grace)
        if self.server is not None:
            await self.server.stop(0)

    async def wait_for_termination(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()
