"""The frontend's grpc.health.v1: readiness says whether new requests start; the admin service stays up.

"" and tandem.v1.GenerationService are the readiness names (load balancers, Kubernetes' readinessProbe,
`tandem health`): SERVING while new requests start (AsyncLLM.serving: not draining, and a connected engine
is neither paused nor asleep), so traffic moves to replicas that serve it. tandem.v1.AdminService is
SERVING from start to shutdown, whatever the engines do: operator calls work in every one of those states
(Resume and WakeUp must reach a paused or sleeping replica), so it is the name for a check that must not
restart a healthy process (the Kubernetes startupProbe, compose's healthcheck).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from tandem.v1 import admin_pb2, generation_pb2

from services.frontend.async_llm import AsyncLLM

log = logging.getLogger(__name__)

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name
READINESS_SERVICES = ("", GENERATION_SERVICE)
PROCESS_SERVICES = (ADMIN_SERVICE,)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class FrontendHealth:
    """The health servicer, kept current by AsyncLLM's listener; `shutdown()` turns every name NOT_SERVING."""

    def __init__(self, llm: AsyncLLM) -> None:
        self.llm = llm
        self.servicer = health_aio.HealthServicer()
        self._ready: bool | None = None
        self._updates: set[asyncio.Task] = set()  # held: the loop keeps only weak references to tasks

    def add_to_server(self, server: grpc.aio.Server) -> None:
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)

    async def start(self) -> None:
        for service in PROCESS_SERVICES:
            await self.servicer.set(service, SERVING)
        self.llm.add_listener(self._schedule_update)
        await self.update()

    def _schedule_update(self) -> None:
        """From a synchronous listener: update on the loop (each update reads the state as it is then)."""
        update = asyncio.ensure_future(self.update())
        self._updates.add(update)
        update.add_done_callback(self._updates.discard)

    async def update(self) -> None:
        reason = self.llm.not_serving_reason
        ready = reason is None
        if ready != self._ready:
            if self._ready is not None or not ready:
                log.info("health %s%s", "SERVING" if ready else "NOT_SERVING", "" if ready else f": {reason}")
            self._ready = ready
        for service in READINESS_SERVICES:
            await self.servicer.set(service, SERVING if ready else NOT_SERVING)

    async def shutdown(self) -> None:
        """NOT_SERVING for every name, for good: the server is going away."""
        self.llm.remove_listener(self._schedule_update)
        await self.servicer.enter_graceful_shutdown()
