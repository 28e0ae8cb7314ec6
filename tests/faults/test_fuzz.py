"""1. Fuzzing every public and admin RPC with hypothesis against the real processes.

Every call must end with a status a client can act on (never INTERNAL or UNKNOWN) within
its deadline (never a hang); streams that end OK end with their usage message; neither
server crashes; afterwards every KV block is free (checked by the `idle_after` fixture).
"""

from __future__ import annotations

import asyncio

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tandem.v1 import admin_pb2, admin_pb2_grpc, generation_pb2_grpc

from tests.faults.probes import random_prompts, read_rest, server_in_flight, token_request, wait_for
from tests.faults.strategies import PUBLIC_CALLS, Call, admin_calls

CALL_TIMEOUT_S = 30.0
OK, INVALID, EXHAUSTED = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
ALLOWED = {  # what each RPC may answer to anything at all
    "Generate": {OK, INVALID, EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS},
    "Chat": {OK, INVALID, EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS},
    "Tokenize": {OK, INVALID, EXHAUSTED},
    "Detokenize": {OK, INVALID, EXHAUSTED},
    "Abort": {OK, EXHAUSTED},
    "GetModelInfo": {OK},
    "GetServerInfo": {OK},
}
ADMIN_ALLOWED = {OK, INVALID}


def fuzz_settings(scale):
    return settings(max_examples=scale.fuzz_examples, deadline=None, database=None,
                    derandomize=scale.name == "quick",  # the quick run in CI is reproducible
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


async def invoke(channel, call: Call) -> tuple[grpc.StatusCode, str]:
    """Run one call to its end; its status code and details."""
    stubs = {"GenerationService": generation_pb2_grpc.GenerationServiceStub,
             "AdminService": admin_pb2_grpc.AdminServiceStub}
    method = getattr(stubs[call.service](channel), call.method)
    try:
        if call.method in ("Generate", "Chat"):
            responses = [r async for r in method(call.request, timeout=CALL_TIMEOUT_S)]
            assert responses and responses[-1].HasField("usage"), f"{call} ended OK without its final message"
        else:
            await method(call.request, timeout=CALL_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return OK, ""


def check(call: Call, code: grpc.StatusCode, details: str, allowed: set, report) -> None:
    report.status(code)
    assert code in allowed, f"{call} ended with {code.name}: {details}"
    assert code == OK or details, f"{call} ended with {code.name} and no message"


def test_fuzz_public_rpcs(stack, idle_after, scale, report):
    frontend = stack.frontends[0]

    @fuzz_settings(scale)
    @given(calls=st.lists(PUBLIC_CALLS, min_size=1, max_size=3))
    def run(calls: list[Call]) -> None:
        async def concurrently():
            async with grpc.aio.insecure_channel(frontend.address) as channel:
                return await asyncio.gather(*(invoke(channel, call) for call in calls))

        for call, (code, details) in zip(calls, asyncio.run(concurrently())):
            check(call, code, details, ALLOWED[call.method], report)
        report.fault("fuzzed call", len(calls))

    run()
    assert stack.engine.running and frontend.running  # neither server crashed
    wait_for(lambda: server_in_flight(frontend.address) == 0, what="the frontend to hold no request")


def test_fuzz_admin_rpcs_with_a_stream_in_flight(stack, idle_after, scale, report, tmp_path):
    frontend = stack.frontends[0]
    stream_request = token_request(random_prompts(1, seed=61)[0], 12)
    probe = token_request(random_prompts(1, seed=62)[0], 4)

    @fuzz_settings(scale)
    @given(calls=st.lists(admin_calls(str(tmp_path)), min_size=1, max_size=4))
    def run(calls: list[Call]) -> None:
        async def sequence():
            async with grpc.aio.insecure_channel(frontend.address) as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                admin = admin_pb2_grpc.AdminServiceStub(channel)
                in_flight = stub.Generate(stream_request, timeout=CALL_TIMEOUT_S)
                await in_flight.read()  # admitted and running before the admin calls start
                outcomes = [await invoke(channel, call) for call in calls]
                # leave the server serving: resumed (also ends a drain), awake, not profiling
                for restore in ("Resume", "WakeUp", "StopProfile"):
                    await getattr(admin, restore)(getattr(admin_pb2, f"{restore}Request")(), timeout=CALL_TIMEOUT_S)
                try:
                    await read_rest(in_flight)
                    stream = OK, ""
                except grpc.aio.AioRpcError as e:
                    stream = e.code(), e.details()
                tokens = [t async for r in stub.Generate(probe, timeout=CALL_TIMEOUT_S)
                          for c in r.completions for t in c.token_ids]
                return outcomes, stream, tokens

        outcomes, stream, tokens = asyncio.run(sequence())
        for call, (code, details) in zip(calls, outcomes):
            check(call, code, details, ADMIN_ALLOWED, report)
        check(Call("GenerationService", "Generate", stream_request), *stream, {OK}, report)
        assert len(tokens) == 4, "the server did not serve again after the admin calls"
        report.fault("fuzzed admin call", len(calls))

    run()
    assert stack.engine.running and frontend.running  # neither server crashed
