"""Client-side probes for the fault suite: requests, token streams, engine stats, settling."""

from __future__ import annotations

import random
import time

import grpc
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from tests.services.conftest import engine_stats

VOCAB = 49152  # SmolLM2's, so its tokenizer fits the tiny model
MAX_MODEL_LEN = 256
CALL_TIMEOUT_S = 60.0  # every call has a deadline: a hang shows up as DEADLINE_EXCEEDED, never as a stuck suite


def greedy(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                     output_kind=common_pb2.OUTPUT_KIND_DELTA, **kwargs)


def token_request(prompt: list[int], max_tokens: int, request_id: str = "") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(request_id=request_id, token_ids=generation_pb2.TokenIds(ids=prompt),
                                          sampling_params=greedy(max_tokens))


def random_prompts(count: int, seed: int, shared_prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = shared_prefix or []
    return [prefix + [rng.randrange(10, VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


async def stream_tokens(stub: generation_pb2_grpc.GenerationServiceStub, request, timeout: float = CALL_TIMEOUT_S):
    """All token ids of one DELTA stream."""
    tokens = []
    async for response in stub.Generate(request, timeout=timeout):
        for chunk in response.completions:
            tokens.extend(chunk.token_ids)
    return tokens


async def read_rest(call) -> list[int]:
    """The token ids of a call's remaining responses (read with `call.read()`)."""
    tokens = []
    while (response := await call.read()) is not grpc.aio.EOF:
        tokens += [t for chunk in response.completions for t in chunk.token_ids]
    return tokens


async def quiet_run(address: str, requests: list) -> list[list[int]]:
    """The reference outputs: each request alone on an otherwise idle stack."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return [await stream_tokens(stub, request) for request in requests]


def busy(stats: common_pb2.SchedulerStats) -> int:
    return stats.num_running_reqs + stats.num_waiting_reqs


def leaked_blocks(stats: common_pb2.SchedulerStats) -> int:
    return stats.num_total_blocks - stats.num_free_blocks


def settle(engine_address: str, timeout: float = 30.0) -> common_pb2.SchedulerStats:
    """Poll until the engine is idle with every KV block free (or timeout); the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(engine_address)
        if (busy(stats) == 0 and leaked_blocks(stats) == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def wait_for(predicate, timeout: float = 30.0, what: str = "a condition"):
    """Poll `predicate()` until truthy; its value (AssertionError naming `what` after timeout)."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.05)
    return value


def server_in_flight(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=10).num_in_flight
