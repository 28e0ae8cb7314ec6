"""Load generators: closed loop (N requests always in flight) and open loop (seeded Poisson arrivals).

Both send every prompt once, in order, and return one RequestRecord per prompt plus the wall
time of the run. `progress` is called once per finished request (a progress bar's update).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from clients.bench.metrics import RequestRecord
from clients.bench.prompts import BenchPrompt
from clients.errors import TandemError


async def run_one(backend, prompt: BenchPrompt) -> RequestRecord:
    """Send one prompt, timing every message; failures are recorded, not raised."""
    record = RequestRecord(start=time.perf_counter(), prompt_tokens=prompt.num_tokens or 0)
    try:
        async for new_tokens, prompt_tokens in backend.stream(prompt):
            record.add_tokens(new_tokens, time.perf_counter())
            if prompt_tokens:
                record.prompt_tokens = prompt_tokens
        record.end = time.perf_counter()
    except TandemError as e:
        record.error = e.code.name
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 - a benchmark counts failures by kind
        record.error = type(e).__name__
    return record


async def closed_loop(backend, prompts: list[BenchPrompt], concurrency: int,
                      progress: Callable[[], None] = lambda: None) -> tuple[list[RequestRecord], float]:
    """`concurrency` workers, each sending its next prompt as soon as its last one finished."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    records: list[RequestRecord | None] = [None] * len(prompts)
    next_index = iter(range(len(prompts)))

    async def worker() -> None:
        for i in next_index:
            records[i] = await run_one(backend, prompts[i])
            progress()

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return records, time.perf_counter() - started


async def open_loop(backend, prompts: list[BenchPrompt], rate: float, seed: int = 0,
                    progress: Callable[[], None] = lambda: None) -> tuple[list[RequestRecord], float]:
    """Requests arrive as a Poisson process of `rate` per second (exponential gaps, seeded),
    whether or not earlier ones have finished."""
    if rate <= 0:
        raise ValueError("rate must be positive (requests per second)")
    rng = random.Random(seed)

    async def timed(prompt: BenchPrompt) -> RequestRecord:
        record = await run_one(backend, prompt)
        progress()
        return record

    started = time.perf_counter()
    tasks, arrival = [], 0.0
    for i, prompt in enumerate(prompts):
        if i:  # absolute arrival times, so slow scheduling does not stretch the schedule
            arrival += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, started + arrival - time.perf_counter()))
        tasks.append(asyncio.ensure_future(timed(prompt)))
    records = await asyncio.gather(*tasks)
    return list(records), time.perf_counter() - started
