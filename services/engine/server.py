"""The engine-core gRPC server: bidi `Connect` streams <-> queues <-> the busy loop.

Each `Connect` is one connection: a reader task converts inputs and submits them to
the busy loop; the busy-loop thread hands outputs to a per-connection bounded outbox
(via `call_soon_threadsafe`) that the handler yields from. When the client goes
away (cancel, end of its input stream, an error) or stops reading until the outbox
overflows (RESOURCE_EXHAUSTED), the connection closes and the busy loop aborts its requests.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection
from tandem.v1 import engine_core_pb2, engine_core_pb2_grpc

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from services.engine import convert
from services.engine.busy_loop import DEFAULT_BURST_WINDOW_S, EngineBusyLoop
from services.engine.health import ENGINE_CORE_SERVICE, EngineHealth
from services.engine.messages import ConnectionOutputs, EngineDied, PauseMode, Utility, UtilityMethod
from services.engine.outbox import DEFAULT_MAX_PENDING_OUTPUTS, ConnectionOutbox, Overflowed
from services.engine.telemetry import EngineTelemetry
from services.security.transport import ENGINE_LINK_MAX_MESSAGE_BYTES, ServerTransport
from services.telemetry.metrics import EngineMetrics, MetricsServer

logger = logging.getLogger(__name__)

_INPUT_ENDED = object()  # the reader's last item on a connection's queue


class EngineCoreServicer(engine_core_pb2_grpc.EngineCoreServiceServicer):
    def __init__(self, busy_loop: EngineBusyLoop, info: engine_core_pb2.GetEngineInfoResponse,
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


def drain(busy_loop: EngineBusyLoop) -> asyncio.Future:
    """Stop admitting (adds are held) and resolve once nothing is in flight: a PAUSE WAIT on a connection
    of our own, answered by the busy loop when its last running request finishes (or at once if it died)."""
    loop = asyncio.get_running_loop()
    drained = loop.create_future()

    def resolve() -> None:
        if not drained.done():
            drained.set_result(None)

    def sink(item) -> None:  # from the busy-loop thread
        if isinstance(item, EngineDied) or (isinstance(item, ConnectionOutputs) and item.utility_result):
            loop.call_soon_threadsafe(resolve)

    connection = busy_loop.open(sink)
    busy_loop.submit(connection, Utility(call_id=0, method=UtilityMethod.PAUSE, pause_mode=PauseMode.WAIT))
    drained.add_done_callback(lambda _: busy_loop.close(connection))
    return drained


class EngineServer:
    """An EngineCore behind `tandem.v1.EngineCoreService`, health and reflection on one address.

    The engine loads in the constructor (so a bad config fails before anything listens);
    `start()` binds (port 0 picks a free port) and returns the port. `transport` sets TLS / mutual
    TLS and the message size limit (default: plaintext, 64 MiB messages).
    """

    def __init__(self, config: EngineConfig, address: str = "127.0.0.1:50061", *, stall_timeout: float = 30.0,
                 max_pending_outputs: int = DEFAULT_MAX_PENDING_OUTPUTS,
                 transport: ServerTransport = ServerTransport(max_message_bytes=ENGINE_LINK_MAX_MESSAGE_BYTES),
                 tracer_provider=None, metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 burst_window_s: float = DEFAULT_BURST_WINDOW_S) -> None:
        self.config = config
        self.address = address
        self.transport = transport
        if max_pending_outputs < 1:
            raise ValueError(f"max_pending_outputs must be >= 1, got {max_pending_outputs}")
        self.max_pending_outputs = max_pending_outputs
        # outputs carry queued/scheduled/preempted events and the prefix cache's changes (for frontends' routers)
        self.engine = EngineCore(config, log_stats=True, kv_events=True)
        self._init_telemetry(tracer_provider, metrics_port, metrics_host)
        self.busy_loop = EngineBusyLoop(self.engine, self.telemetry, burst_window_s)
        self.health = EngineHealth(self.busy_loop, stall_timeout)
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    def _init_telemetry(self, tracer_provider, metrics_port: int | None, metrics_host: str) -> None:
        """Request spans when a tracer provider is given; /metrics on `metrics_port` unless it is None."""
        self.metrics_server: MetricsServer | None = None
        metrics = None
        if metrics_port is not None:
            metrics = EngineMetrics(self.engine.info.model_name)
            self.metrics_server = MetricsServer(metrics.registry, metrics_host, metrics_port)
        self.telemetry = EngineTelemetry(tracer_provider, metrics) if tracer_provider or metrics else None
        self.metrics_port: int | None = None

    async def start(self, start_busy_loop: bool = True) -> int:
        """Listen (returns the port). The busy loop gets a thread of its own unless `start_busy_loop` is
        False, when the caller runs it (`tandem-engine` runs it on the main thread: services/engine/process.py)."""
        self.server = self.transport.server()
        info = convert.engine_info_to_proto(self.engine.info, self.engine.config)  # the budget as resolved
        servicer = EngineCoreServicer(self.busy_loop, info, self.max_pending_outputs)
        engine_core_pb2_grpc.add_EngineCoreServiceServicer_to_server(servicer, self.server)
        self.health.add_to_server(self.server)
        services = (ENGINE_CORE_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(services, self.server)
        self.port = self.transport.add_port(self.server, self.address)
        if self.port == 0:
            raise RuntimeError(f"could not listen on {self.address}")
        if self.metrics_server is not None:
            self.metrics_port = self.metrics_server.start()
        if start_busy_loop:
            self.busy_loop.start()
        await self.server.start()
        await self.health.start()
        logger.info("engine core serving %s on port %d", self.engine.info.model_path, self.port)
        if self.metrics_port is not None:
            logger.info("Prometheus metrics on http://%s:%d/metrics", self.metrics_server.host, self.metrics_port)
        return self.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Drain, then stop: new requests are held (not started) and health says NOT_SERVING; requests in
        flight get up to `grace` seconds to finish; then the streams close (held requests end UNAVAILABLE at
        their frontends, which retry elsewhere) and the loop stops."""
        drained = drain(self.busy_loop) if grace else None
        await self.health.shutdown()
        if drained is not None:
            try:
                await asyncio.wait_for(drained, grace)
            except asyncio.TimeoutError:
                logger.warning("requests still in flight after the %.1f s grace period are cut off", grace)
        if self.server is not None:
            await self.server.stop(0)
        await asyncio.to_thread(self.busy_loop.stop)
        if self.metrics_server is not None:
            self.metrics_server.stop()

    async def wait_for_termination(self) -> None:
        if self.server is not None:
            await self.server.wait_for_termination()
