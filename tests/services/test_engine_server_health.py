"""Engine server health, reflection and failures: stalls, stop and a crashed busy loop."""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tests.services.engine_server_harness import (
    LONG,
    NOT_SERVING,
    SERVING,
    health_status,
    wait_health,
)


# ---- health, reflection, failures -------------------------------------------------------
def test_reflection_lists_the_services(engine_server):
    with grpc.insecure_channel(engine_server.target) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"tandem.v1.EngineCoreService", "grpc.health.v1.Health"} <= set(services)


def test_health_goes_not_serving_while_the_loop_stalls(make_server):
    server = make_server(stall_timeout=0.3)
    assert health_status(server.target) == SERVING
    assert health_status(server.target, "tandem.v1.EngineCoreService") == SERVING
    unblock = threading.Event()
    try:
        server.server.busy_loop.run_in_loop(lambda: unblock.wait(20))
        wait_health(server.target, NOT_SERVING)
        assert health_status(server.target, "tandem.v1.EngineCoreService") == NOT_SERVING
    finally:
        unblock.set()
    wait_health(server.target, SERVING)


def test_health_goes_not_serving_on_stop(make_server):
    server = make_server()
    channel = grpc.insecure_channel(server.target)
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == SERVING
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 1.0})
        stopper.start()
        assert next(watch).status == NOT_SERVING
        stopper.join()
    finally:
        channel.close()


def test_a_crashed_loop_fails_streams_and_health(make_server, connect):
    server = make_server()
    stream = connect(server.target)
    stream.add("r", [5, 6], **LONG)
    stream.wait(lambda: stream.tokens.get("r"))

    def crash():
        raise RuntimeError("boom")

    server.server.busy_loop.run_in_loop(crash)
    stream.wait(lambda: stream.ended)
    assert stream.rpc_error.code() == grpc.StatusCode.UNAVAILABLE
    assert "boom" in stream.rpc_error.details()
    wait_health(server.target, NOT_SERVING)
    late = connect(server.target)
    late.wait(lambda: late.ended)
    assert late.rpc_error.code() == grpc.StatusCode.UNAVAILABLE
