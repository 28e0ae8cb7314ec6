"""7. Graceful drain: SIGTERM stops new work, lets in-flight streams finish, then the process exits 0."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import generation_pb2_grpc

from tests.faults.probes import CALL_TIMEOUT_S, quiet_run, random_prompts, read_rest, stream_tokens, token_request

GRACE_S = 30  # the frontends' --grace in this suite


async def not_serving(channel) -> bool:
    """Health says NOT_SERVING, or the server no longer takes calls at all."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code() == grpc.StatusCode.UNAVAILABLE
    return reply.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_sigterm_refuses_new_calls_and_finishes_streams_in_flight(stack, idle_after, report):
    frontend = stack.add_frontend(name="frontend-drain")
    requests = [token_request(p, 96) for p in random_prompts(6, seed=31)]
    expected = asyncio.run(quiet_run(stack.frontends[0].address, requests))

    async def drain():
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            calls = [stub.Generate(r, timeout=CALL_TIMEOUT_S) for r in requests]
            firsts = [await call.read() for call in calls]  # every stream is running
            frontend.signal(15)  # SIGTERM
            report.fault("SIGTERM (drain)")
            while not await not_serving(channel):
                await asyncio.sleep(0.02)
            try:
                await stream_tokens(stub, requests[0], timeout=10)
                new_call = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as e:
                new_call = e.code(), e.details()
            return [list(first.completions[0].token_ids) + await read_rest(call)
                    for first, call in zip(firsts, calls)], new_call

    try:
        got, (code, details) = asyncio.run(drain())
        exit_code = frontend.process.wait(GRACE_S + 30)
    finally:
        frontend.stop()
    report.status(code)
    for _ in got:
        report.status(grpc.StatusCode.OK)
    assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
    assert "draining" in details, details
    assert got == expected
    assert exit_code == 0
