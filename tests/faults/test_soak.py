"""8. Soak (long suite only): a bounded mixed workload with random cancels and prefix sharing.

Workers send text and token prompts that share a few long prefixes, with random lengths,
n > 1, stop strings and cancels at random moments, for `scale.soak_seconds`. The frontend's
and engine's RSS, sampled all along, must stay flat after warm-up, and every KV block is
free at the end (the `idle_after` fixture).
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from tests.faults.probes import CALL_TIMEOUT_S, VOCAB, server_in_flight, wait_for

WORKERS = 12
WARM_UP_FRACTION = 0.25
RSS_SLACK_MIB = 48  # allocator noise; a leak of a block per request would be far beyond it over a soak
RSS_SLACK_FRACTION = 0.10


def mixed_request(rng: random.Random, prefixes: list[list[int]]) -> generation_pb2.GenerateRequest:
    params = common_pb2.SamplingParams(max_tokens=rng.randrange(1, 64), n=rng.choice((1, 1, 1, 2)),
                                       temperature=rng.choice((0.0, 0.8)), seed=rng.randrange(1 << 30),
                                       output_kind=rng.choice((1, 1, 2, 3)))
    if rng.random() < 0.2:
        params.stop.append(rng.choice(("the", "a", "\n", "!")))
    if rng.random() < 0.3:
        return generation_pb2.GenerateRequest(text=" ".join(rng.choice(("tandem", "engine", "the", "a", "cat", "猫"))
                                                            for _ in range(rng.randrange(1, 60))),
                                              sampling_params=params)
    prompt = rng.choice(prefixes) + [rng.randrange(10, VOCAB) for _ in range(rng.randrange(1, 24))]
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=prompt), sampling_params=params)


async def worker(stub, rng: random.Random, prefixes, stop_at: float, report) -> None:
    while time.monotonic() < stop_at:
        call = stub.Generate(mixed_request(rng, prefixes), timeout=CALL_TIMEOUT_S)
        cancel_after = rng.randrange(0, 6) if rng.random() < 0.3 else None
        try:
            read = 0
            while await call.read() is not grpc.aio.EOF:
                read += 1
                if read == cancel_after:
                    call.cancel()
                    break
            if cancel_after == 0:
                call.cancel()
            code = await call.code()
        except grpc.aio.AioRpcError as e:
            code = e.code()
        report.status(code)
        if code == grpc.StatusCode.CANCELLED:
            report.cancelled += 1
            report.fault("soak cancel")
        assert code in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED), code


def test_soak_memory_flat_and_blocks_free(stack, idle_after, scale, report):
    if not scale.soak_seconds:
        pytest.skip("the soak runs in the long suite: make test-faults-long")
    frontend = stack.frontends[0]
    rng = random.Random(81)
    prefixes = [[rng.randrange(10, VOCAB) for _ in range(rng.randrange(32, 120))] for _ in range(6)]
    samples: list[tuple[float, float, float]] = []  # (seconds, engine RSS, frontend RSS)

    async def soak() -> None:
        start = time.monotonic()
        stop_at = start + scale.soak_seconds
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            workers = [asyncio.create_task(worker(stub, random.Random(i), prefixes, stop_at, report))
                       for i in range(WORKERS)]
            while not all(w.done() for w in workers):
                samples.append((time.monotonic() - start, stack.engine.rss_mib(), frontend.rss_mib()))
                await asyncio.wait(workers, timeout=2.0)
            await asyncio.gather(*workers)

    asyncio.run(soak())
    wait_for(lambda: server_in_flight(frontend.address) == 0, what="the frontend to hold no request")
    warm = [s for s in samples if s[0] <= scale.soak_seconds * WARM_UP_FRACTION]
    late = [s for s in samples if s[0] > scale.soak_seconds * (1 - WARM_UP_FRACTION)]
    for column, name in ((1, "engine"), (2, "frontend")):
        baseline, final = max(s[column] for s in warm), max(s[column] for s in late)
        print(f"soak RSS {name}: warm-up peak {baseline:.1f} MiB, last-quarter peak {final:.1f} MiB")
        assert final <= baseline * (1 + RSS_SLACK_FRACTION) + RSS_SLACK_MIB, (name, baseline, final)
