"""3. The engine core killed with SIGKILL mid-batch, then restarted on the same port; 7. its SIGTERM drain.

SIGKILL: in-flight streams end with UNAVAILABLE (each call has a deadline, so a hang would
show as DEADLINE_EXCEEDED), readiness turns NOT_SERVING, new calls get UNAVAILABLE with a
message that names the cause, and once the engine is back the frontend reconnects by itself
and serves the same tokens as before. SIGTERM: streams in flight finish in full, a request
that arrives meanwhile is held and ends UNAVAILABLE (retry elsewhere), the process exits 0.
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import generation_pb2, generation_pb2_grpc

from clients.local_stack import wait_until_serving
from tests.faults.probes import (
    CALL_TIMEOUT_S,
    MAX_MODEL_LEN,
    leaked_blocks,
    quiet_run,
    random_prompts,
    read_rest,
    settle,
    stream_tokens,
    token_request,
)
from tests.waits import STARTUP_TIMEOUT_S

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def outcome(call) -> tuple[grpc.StatusCode, str]:
    """Read a call to its end; its status code and details."""
    try:
        await read_rest(call)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


@pytest.fixture(scope="module")
def engine_stack(make_fault_stack):
    """An engine of its own (these tests kill it) with one frontend."""
    stack = make_fault_stack("--grace", "30")
    stack.add_frontend()
    return stack


def test_engine_sigkill_mid_batch_then_restart(engine_stack, report):
    stack = engine_stack
    stack.ensure_engine_serving()
    frontend = stack.frontends[0]
    in_flight = [token_request(p, MAX_MODEL_LEN - 60) for p in random_prompts(8, seed=51)]
    probe = token_request(random_prompts(1, seed=52)[0], 24)
    [expected] = asyncio.run(quiet_run(frontend.address, [probe]))

    async def kill_mid_batch():
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            calls = [stub.Generate(r, timeout=CALL_TIMEOUT_S) for r in in_flight]
            for call in calls:
                await call.read()  # every stream is in the running batch
            stack.engine.kill()
            report.fault("engine SIGKILL")
            ended = [await outcome(call) for call in calls]
            health = health_pb2_grpc.HealthStub(channel)
            status = (await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)).status
            try:
                await stream_tokens(stub, probe, timeout=10)
                refused = grpc.StatusCode.OK, ""
            except grpc.aio.AioRpcError as e:
                refused = e.code(), e.details()
            tokenized = await stub.Tokenize(generation_pb2.TokenizeRequest(text="still here"), timeout=10)
            return ended, status, refused, tokenized

    ended, status, (code, details), tokenized = asyncio.run(kill_mid_batch())
    for c, _ in [*ended, (code, details)]:
        report.status(c)
    assert all(c == grpc.StatusCode.UNAVAILABLE for c, _ in ended), ended
    assert all("disconnected" in d and stack.engine.address in d for _, d in ended), ended[0]
    assert status == NOT_SERVING
    assert code == grpc.StatusCode.UNAVAILABLE and "no engine is connected" in details, (code, details)
    assert tokenized.token_ids  # the frontend itself is still up

    stack.restart_engine()
    report.fault("engine restart")
    wait_until_serving(frontend.address, STARTUP_TIMEOUT_S)  # the frontend reconnected by itself
    assert asyncio.run(quiet_run(frontend.address, [probe])) == [expected]
    report.status(grpc.StatusCode.OK)
    assert frontend.running
    stats = settle(stack.engine.address)
    assert leaked_blocks(stats) == 0


async def engine_not_serving(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                if reply.status == NOT_SERVING:
                    return
            except grpc.aio.AioRpcError:
                return
            await asyncio.sleep(0.02)


def test_engine_sigterm_finishes_streams_in_flight_then_exits_0(engine_stack, report):
    stack = engine_stack
    stack.ensure_engine_serving()
    frontend = stack.frontends[0]
    requests = [token_request(p, 96) for p in random_prompts(6, seed=53)]
    late = token_request(random_prompts(1, seed=54)[0], 8)
    expected = asyncio.run(quiet_run(frontend.address, requests))

    async def drain():
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            calls = [stub.Generate(r, timeout=CALL_TIMEOUT_S) for r in requests]
            firsts = [await call.read() for call in calls]  # every stream is running
            stack.engine.signal(signal.SIGTERM)
            report.fault("engine SIGTERM (drain)")
            await engine_not_serving(stack.engine.address)
            *rests, late_outcome = await asyncio.gather(*(read_rest(call) for call in calls),
                                                        outcome(stub.Generate(late, timeout=CALL_TIMEOUT_S)))
            return [list(f.completions[0].token_ids) + rest for f, rest in zip(firsts, rests)], late_outcome

    got, (code, details) = asyncio.run(drain())
    exit_code = stack.engine.process.wait(60)
    report.status(code)
    for _ in got:
        report.status(grpc.StatusCode.OK)
    assert got == expected
    assert code == grpc.StatusCode.UNAVAILABLE and "disconnected" in details, (code, details)
    assert exit_code == 0
