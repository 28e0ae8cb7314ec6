"""The gRPC probes in deploy/k8s ask the real servers for service names they actually report.

The kubelet's gRPC probe (and docker/healthcheck.py, the TLS overlay's exec probe) is one
grpc.health.v1 Check for a service name: a name the server never sets answers NOT_FOUND and the pod
never becomes ready. So each probe's name is checked
against a live engine and frontend (tiny model, loopback) rather than against a copy of the names:
a renamed service fails here, not on a cluster. The same live stack is then drained, paused and put to
sleep: the frontend's readiness must fail (traffic moves away) while no startup or liveness probe does
(the kubelet would restart a healthy process), and the engine's probes must all pass (its readiness
decides whether frontends find it in DNS, and so whether a WakeUp can reach it).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import admin_pb2, common_pb2

from services.engine.health import SERVICES as ENGINE_HEALTH_SERVICES
from tests.deploy.conftest import PROBES, Workload, probe_target
from tests.waits import STATE_TIMEOUT_S

# operator calls that put the stack in a state, and the call that ends it
STATES = {
    "drained": ("Drain", admin_pb2.DrainRequest(timeout_s=0), "Resume", admin_pb2.ResumeRequest()),
    "paused": ("Pause", admin_pb2.PauseRequest(mode=common_pb2.PAUSE_MODE_KEEP), "Resume", admin_pb2.ResumeRequest()),
    "asleep": ("Sleep", admin_pb2.SleepRequest(), "WakeUp", admin_pb2.WakeUpRequest()),
}


def grpc_probe_services(workload: Workload, kinds=PROBES) -> set[str]:
    """The health service names the gRPC and exec (docker/healthcheck.py) probes of `kinds` ask for."""
    names = {probe_target(workload.container[kind]).service for kind in kinds}
    return names - {None}  # a TCP check asks for none


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


def test_every_grpc_probe_names_a_service_the_live_server_reports_serving(overlays, make_stack):
    engine_names = {name for rendered in overlays.values() for name in grpc_probe_services(rendered.engine)}
    frontend_names = {name for rendered in overlays.values() for name in grpc_probe_services(rendered.frontend)}
    assert engine_names <= set(ENGINE_HEALTH_SERVICES), f"the engine sets health for {ENGINE_HEALTH_SERVICES} only"
    stack = make_stack()
    assert stack.run(statuses(stack.engine.port, engine_names)) == dict.fromkeys(engine_names, "SERVING")
    assert stack.run(statuses(stack.frontend.port, frontend_names)) == dict.fromkeys(frontend_names, "SERVING")
    assert len(frontend_names) >= 2 and len(engine_names) >= 2  # the whole server ("") and the API service


@pytest.mark.parametrize("state", STATES)
def test_only_the_frontends_readiness_fails_while_drained_paused_or_asleep(overlays, make_stack, state):
    frontends = [rendered.frontend for rendered in overlays.values()]
    ready = {name for f in frontends for name in grpc_probe_services(f, ["readinessProbe"])}
    alive = {name for f in frontends for name in grpc_probe_services(f, ["startupProbe", "livenessProbe"])}
    engine_names = {name for rendered in overlays.values() for name in grpc_probe_services(rendered.engine)}
    assert ready and alive and not ready & alive
    enter, enter_request, leave, leave_request = STATES[state]
    stack = make_stack()

    async def engine_during_state() -> dict[str, str]:
        assert (await getattr(stack.admin, enter)(enter_request, timeout=30)).ok
        deadline = asyncio.get_running_loop().time() + STATE_TIMEOUT_S
        while (frontend := await statuses(stack.frontend.port, ready | alive)) != {
                **dict.fromkeys(ready, "NOT_SERVING"), **dict.fromkeys(alive, "SERVING")}:
            assert asyncio.get_running_loop().time() < deadline, frontend  # the engine's news is on its way
            await asyncio.sleep(0.02)
        engine = await statuses(stack.engine.port, engine_names)
        assert (await getattr(stack.admin, leave)(leave_request, timeout=30)).ok
        return engine

    assert stack.run(engine_during_state()) == dict.fromkeys(engine_names, "SERVING")
