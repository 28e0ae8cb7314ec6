"""Standard grpc.health.v1 for the engine core, driven by a watchdog over the busy loop.

Both "" (the whole server) and "tandem.v1.EngineCoreService" report SERVING while the busy
loop is alive and making progress; NOT_SERVING when it died, or when it has work but
completed no step for `stall_timeout` seconds (SERVING again once it recovers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.engine.processes.busy_loop_interface import BusyLoop

logger = logging.getLogger(__name__)

ENGINE_CORE_SERVICE = "tandem.v1.EngineCoreService"
SERVICES = ("", ENGINE_CORE_SERVICE)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EngineHealth:
    def __init__(self, busy_loop: BusyLoop, stall_timeout: float = 30.0) -> None:
        if stall_timeout <= 0:
            raise ValueError(f"stall_timeout must be > 0 seconds, got {stall_timeout}")
        self.busy_loop = busy_loop
        self.stall_timeout = stall_timeout
        self.servicer = health.aio.HealthServicer()
        self._status = None
        self._watchdog: asyncio.Task | None = None

    def add_to_server(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        """Report the current status, then keep it current from a watchdog task."""
        await self._update()
        self._watchdog = asyncio.create_task(self._watch(), name="engine-health-watchdog")

    async def shutdown(self) -> None:
        """NOT_SERVING for good (the server is going away)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        await self.servicer.enter_graceful_shutdown()

    def is_serving(self) -> bool:
        return self.busy_loop.alive and not self.busy_loop.stalled(self.stall_timeout)

    async def _watch(self) -> None:
        period = min(self.stall_timeout / 4, 1.0)
        while True:
            await asyncio.sleep(period)
            await self._update()

    async def _update(self) -> None:
        status = SERVING if self.is_serving() else NOT_SERVING
        if status == self._status:
            return
        if status == NOT_SERVING:
            reason = self.busy_loop.error or f"no progress for over {self.stall_timeout:g} s"
            logger.warning("engine core NOT_SERVING: %s", reason)
        elif self._status is not None:
            logger.info("engine core SERVING again")
        self._status = status
        for service in SERVICES:
            await self.servicer.set(service, status)
