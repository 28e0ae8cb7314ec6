"""An engine core in this process behind its gRPC service: `EngineServer`.

The EngineCore, its busy loop, request telemetry and /metrics live here; the gRPC side
(services/engine/grpc_service.py) serves them. `start()` runs the busy loop on a thread of its
own beside the server: for servers embedded in a test's or a tool's process. `tandem-engine`
instead steps this server's busy loop on its main thread and serves gRPC from a process of its
own (services/engine/processes/engine_process.py).
"""

from __future__ import annotations

import asyncio
import logging

from engine_core.config import EngineConfig
from engine_core.engine_core import EngineCore
from services.engine import convert
from services.engine.busy_loop import DEFAULT_BURST_WINDOW_S, EngineBusyLoop
from services.engine.grpc_service import EngineGrpcServer
from services.engine.outbox import DEFAULT_MAX_PENDING_OUTPUTS
from services.engine.telemetry import EngineTelemetry
from services.security.transport import ENGINE_LINK_MAX_MESSAGE_BYTES, ServerTransport
from services.telemetry.metrics import EngineMetrics, MetricsServer

logger = logging.getLogger(__name__)


class EngineServer:
    """An EngineCore in this process behind `tandem.v1.EngineCoreService`, health and reflection.

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
        if stall_timeout <= 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {stall_timeout}")
        self.max_pending_outputs = max_pending_outputs
        self.stall_timeout = stall_timeout
        # outputs carry queued/scheduled/preempted events and the prefix cache's changes (for frontends' routers)
        self.engine = EngineCore(config, log_stats=True, kv_events=True)
        self.engine.ready_to_serve()  # warm before anything listens: health's first SERVING means warm
        self._init_telemetry(tracer_provider, metrics_port, metrics_host)
        self.busy_loop = EngineBusyLoop(self.engine, self.telemetry, burst_window_s)
        self.grpc: EngineGrpcServer | None = None
        self.port: int | None = None

    def _init_telemetry(self, tracer_provider, metrics_port: int | None, metrics_host: str) -> None:
        """Request spans when a tracer provider is given; /metrics on `metrics_port` unless it is None."""
        self.metrics_server: MetricsServer | None = None
        metrics = None
        if metrics_port is not None:
            metrics = EngineMetrics(self.engine.info.model_name)
            metrics.compiles_after_ready.set_function(lambda: self.engine.compile_monitor.compiles_after_ready)
            self.metrics_server = MetricsServer(metrics.registry, metrics_host, metrics_port)
        self.telemetry = EngineTelemetry(tracer_provider, metrics) if tracer_provider or metrics else None
        self.metrics_port: int | None = None

    def info_proto(self):
        """What GetEngineInfo answers (the token budget as resolved)."""
        return convert.engine_info_to_proto(self.engine.info, self.engine.config)

    def start_metrics(self) -> None:
        if self.metrics_server is not None and self.metrics_port is None:
            self.metrics_port = self.metrics_server.start()
            logger.info("Prometheus metrics on http://%s:%d/metrics", self.metrics_server.host, self.metrics_port)

    def stop_metrics(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()

    async def start(self) -> int:
        """Listen (returns the port), the busy loop on a thread of its own."""
        self.grpc = EngineGrpcServer(self.busy_loop, self.info_proto(), self.address, stall_timeout=self.stall_timeout,
                                     max_pending_outputs=self.max_pending_outputs, transport=self.transport)
        self.port = await self.grpc.start()
        self.start_metrics()
        self.busy_loop.start()
        logger.info("engine core serving %s on port %d", self.engine.info.model_path, self.port)
        return self.port

    async def stop(self, grace: float | None = 5.0) -> None:
        """Drain, then stop: new requests are held (not started) and health says NOT_SERVING; requests in
        flight get up to `grace` seconds to finish; then the streams close (held requests end UNAVAILABLE at
        their frontends, which retry elsewhere) and the loop stops."""
        if self.grpc is not None:
            await self.grpc.stop(grace)
        await asyncio.to_thread(self.busy_loop.stop)
        self.stop_metrics()

    async def wait_for_termination(self) -> None:
        if self.grpc is not None:
            await self.grpc.wait_for_termination()
