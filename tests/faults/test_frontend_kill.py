"""4. A frontend killed mid-stream: the engine frees its requests; a second frontend is unaffected.

The engine is frozen (Pause KEEP) around the kill, so nothing can finish on its own: the
only way its in-flight count drops is by aborting the dead frontend's requests.
"""

from __future__ import annotations

import asyncio

import grpc
from tandem.v1 import generation_pb2_grpc

from tests.faults.admin import frozen
from tests.faults.probes import (
    CALL_TIMEOUT_S,
    MAX_MODEL_LEN,
    busy,
    engine_stats,
    quiet_run,
    random_prompts,
    read_rest,
    token_request,
    wait_for,
)


def test_killed_frontend_frees_its_requests_and_the_other_frontend_streams_on(stack, idle_after, report):
    survivor_frontend = stack.frontends[0]
    victim = stack.add_frontend(name="frontend-victim")
    victim_requests = [token_request(p, MAX_MODEL_LEN - 60) for p in random_prompts(6, seed=41)]
    survivors = [token_request(p, 64) for p in random_prompts(4, seed=42)]
    expected = asyncio.run(quiet_run(survivor_frontend.address, survivors))

    async def run():
        async with grpc.aio.insecure_channel(victim.address) as victim_channel, \
                grpc.aio.insecure_channel(survivor_frontend.address) as channel:
            doomed = [generation_pb2_grpc.GenerationServiceStub(victim_channel).Generate(r, timeout=CALL_TIMEOUT_S)
                      for r in victim_requests]
            calls = [generation_pb2_grpc.GenerationServiceStub(channel).Generate(r, timeout=CALL_TIMEOUT_S)
                     for r in survivors]
            for call in doomed:
                await call.read()  # running in the engine
            firsts = [await call.read() for call in calls]
            with frozen(survivor_frontend.address):
                before = await asyncio.to_thread(lambda: busy(engine_stats(stack.engine.address)))
                assert before >= len(doomed)
                victim.kill()
                report.fault("frontend SIGKILL")
                def freed() -> bool:
                    return busy(engine_stats(stack.engine.address)) == before - len(doomed)

                await asyncio.to_thread(wait_for, freed, 30, "the engine to abort the dead frontend's requests")
                for call in doomed:
                    assert await call.code() == grpc.StatusCode.UNAVAILABLE
                    report.status(grpc.StatusCode.UNAVAILABLE)
            return [list(first.completions[0].token_ids) + await read_rest(call)
                    for first, call in zip(firsts, calls)]

    assert asyncio.run(run()) == expected
    for _ in survivors:
        report.status(grpc.StatusCode.OK)
