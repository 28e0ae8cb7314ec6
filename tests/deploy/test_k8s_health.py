"""The gRPC probes in deploy/k8s ask the real servers for service names they actually report.

The kubelet's gRPC probe (and docker/healthcheck.py, the TLS overlay's exec probe) is one
grpc.health.v1 Check for a service name: a name the server never sets answers NOT_FOUND and the pod
never becomes ready. So each probe's name is checked
against a live engine and frontend (tiny model, loopback) rather than against a copy of the names:
a renamed service fails here, not on a cluster.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.engine.health import SERVICES as ENGINE_HEALTH_SERVICES
from tests.deploy.conftest import PROBES, Workload, probe_target


def grpc_probe_services(workload: Workload) -> set[str]:
    """The health service names the gRPC and exec (docker/healthcheck.py) probes ask for."""
    names = {probe_target(workload.container[kind]).service for kind in PROBES}
    return names - {None}  # a TCP check asks for none


def test_every_grpc_probe_names_a_service_the_live_server_reports_serving(overlays, make_stack):
    engine_names = {name for rendered in overlays.values() for name in grpc_probe_services(rendered.engine)}
    frontend_names = {name for rendered in overlays.values() for name in grpc_probe_services(rendered.frontend)}
    assert engine_names <= set(ENGINE_HEALTH_SERVICES), f"the engine sets health for {ENGINE_HEALTH_SERVICES} only"
    stack = make_stack()

    async def statuses(port: int, names: set[str]) -> dict[str, str]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            found = {}
            for name in sorted(names):
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                    found[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                except grpc.aio.AioRpcError as exc:
                    found[name] = exc.code().name
            return found

    assert stack.run(statuses(stack.engine.port, engine_names)) == dict.fromkeys(engine_names, "SERVING")
    assert stack.run(statuses(stack.frontend.port, frontend_names)) == dict.fromkeys(frontend_names, "SERVING")
    assert len(frontend_names) >= 2 and len(engine_names) >= 2  # the whole server ("") and the API service
