"""2. Cancellation storm: streams cancelled at random moments leak nothing and disturb no one.

Cancels land before the first token, mid-stream, after the finish, or as short deadlines,
while survivor streams run beside them again and again; every survivor must equal its
quiet run, and afterwards the engine is idle with every KV block free.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import grpc
from tandem.v1 import generation_pb2_grpc

from tests.faults.probes import CALL_TIMEOUT_S, quiet_run, random_prompts, server_in_flight, token_request, wait_for

MOMENTS = ("before_first_token", "mid_stream", "after_finish", "deadline")
EXPECTED = {  # how each kind of cancel may end: a cancel that lands after the finish changes nothing
    "before_first_token": {grpc.StatusCode.CANCELLED, grpc.StatusCode.OK},
    "mid_stream": {grpc.StatusCode.CANCELLED, grpc.StatusCode.OK},
    "after_finish": {grpc.StatusCode.OK},
    "deadline": {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK},
}


async def cancel_one(stub, request, moment: str, rng: random.Random) -> grpc.StatusCode:
    timeout = rng.uniform(0.02, 0.5) if moment == "deadline" else CALL_TIMEOUT_S
    call = stub.Generate(request, timeout=timeout)
    try:
        if moment == "before_first_token":
            await asyncio.sleep(rng.choice((0, 0, 0.001, 0.005)))
        elif moment == "mid_stream":
            for _ in range(rng.randrange(1, 4)):
                if await call.read() is grpc.aio.EOF:
                    break
        else:
            while await call.read() is not grpc.aio.EOF:
                pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    call.cancel()  # after the finish: a no-op
    return await call.code()


async def storm(address: str, survivors: list, expected: list, count: int, concurrency: int, report) -> Counter:
    rng = random.Random(2024)
    prompts = random_prompts(48, seed=3)  # reused, so the storm also hits and frees prefix-cache blocks
    outcomes: Counter = Counter()
    survivor_rounds = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        slots = asyncio.Semaphore(concurrency)
        done = asyncio.Event()

        async def one(i: int) -> None:
            async with slots:
                moment = MOMENTS[i % len(MOMENTS)]
                request = token_request(rng.choice(prompts), rng.randrange(1, 80))
                code = await cancel_one(stub, request, moment, rng)
                report.status(code)
                if code != grpc.StatusCode.OK:
                    report.cancelled += 1
                    report.fault("client deadline" if moment == "deadline" else "client cancel")
                assert code in EXPECTED[moment], f"a {moment} cancel ended with {code}"
                outcomes[(moment, code.name)] += 1

        async def survive() -> None:
            nonlocal survivor_rounds
            while not done.is_set():
                got = await asyncio.gather(*(_tokens(stub, r) for r in survivors))
                assert got == expected, "a survivor's output changed during the storm"
                survivor_rounds += 1
                report.requests += len(survivors)

        survivor_task = asyncio.create_task(survive())
        try:
            await asyncio.gather(*(one(i) for i in range(count)))
        finally:
            done.set()
            await survivor_task
    assert survivor_rounds >= 1
    return outcomes


async def _tokens(stub, request) -> list[int]:
    return [t async for response in stub.Generate(request, timeout=CALL_TIMEOUT_S)
            for chunk in response.completions for t in chunk.token_ids]


def test_cancellation_storm_leaks_no_block_and_spares_other_streams(stack, idle_after, scale, report):
    frontend = stack.frontends[0]
    survivors = [token_request(p, 40) for p in random_prompts(4, seed=11)]
    expected = asyncio.run(quiet_run(frontend.address, survivors))
    outcomes = asyncio.run(storm(frontend.address, survivors, expected, scale.cancelled_streams,
                                 scale.storm_concurrency, report))
    cancelled = sum(n for (moment, code), n in outcomes.items() if code != "OK")
    assert cancelled >= scale.cancelled_streams // 2, outcomes  # most cancels really cut a stream short
    wait_for(lambda: server_in_flight(frontend.address) == 0, what="the frontend to forget every request")
