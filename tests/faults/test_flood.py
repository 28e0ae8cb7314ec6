"""6. Flood: far more concurrent streams than the engine runs plus the frontend's waiting limit.

The engine is frozen (Pause KEEP) while the flood arrives, so no admitted stream can finish
and make room: exactly `limit` streams are admitted, every other call ends with
RESOURCE_EXHAUSTED at once (while the engine is still frozen), and after Resume every
admitted stream finishes in full.
"""

from __future__ import annotations

import asyncio

import grpc
from tandem.v1 import generation_pb2_grpc

from tests.faults.admin import frozen
from tests.faults.probes import CALL_TIMEOUT_S, random_prompts, server_in_flight, token_request

MAX_NUM_SEQS = 16  # the shared engine's --max-num-seqs
WAITING = 8
LIMIT = MAX_NUM_SEQS + WAITING
MAX_TOKENS = 6


async def one_stream(stub, request) -> tuple[grpc.StatusCode, str, int]:
    tokens = 0
    try:
        async for response in stub.Generate(request, timeout=CALL_TIMEOUT_S):
            tokens += sum(len(chunk.token_ids) for chunk in response.completions)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details(), tokens
    return grpc.StatusCode.OK, "", tokens


def test_flood_is_refused_at_once_and_admitted_streams_all_finish(stack, idle_after, scale, report):
    frontend = stack.add_frontend("--max-waiting-requests", str(LIMIT), name="frontend-flood")
    requests = [token_request(p, MAX_TOKENS) for p in random_prompts(scale.flood_streams, seed=6)]

    async def flood() -> list[tuple[grpc.StatusCode, str, int]]:
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            with frozen(frontend.address):
                calls = [asyncio.create_task(one_stream(stub, r)) for r in requests]

                def ended(code: grpc.StatusCode) -> int:
                    return sum(c.done() and c.result()[0] == code for c in calls)

                while ended(grpc.StatusCode.RESOURCE_EXHAUSTED) < len(requests) - LIMIT:  # all while frozen
                    assert ended(grpc.StatusCode.OK) == 0, "a stream finished while the engine was frozen"
                    await asyncio.sleep(0.05)
                assert await asyncio.to_thread(server_in_flight, frontend.address) == LIMIT
            return await asyncio.gather(*calls)

    try:
        results = asyncio.run(asyncio.wait_for(flood(), CALL_TIMEOUT_S))
    finally:
        frontend.stop()
    for code, _, _ in results:
        report.status(code)
    report.fault("flood streams over the limit", len(requests) - LIMIT)
    admitted = [r for r in results if r[0] == grpc.StatusCode.OK]
    refused = [r for r in results if r[0] != grpc.StatusCode.OK]
    assert len(admitted) == LIMIT and all(tokens == MAX_TOKENS for _, _, tokens in admitted)
    assert {code for code, _, _ in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all("--max-waiting-requests" in details for _, details, _ in refused), refused[0]
