"""5. Slow and stalled readers: a client that never reads cannot hold the engine or grow memory.

Stalled clients use a tiny HTTP/2 window and never read, so the server's writes block
after a few messages. The frontend buffers at most --max-unsent-tokens per stream (the
slot merges deltas) and then aborts the request with RESOURCE_EXHAUSTED, freeing its KV
blocks; the engine buffers at most --max-pending-outputs messages per connection and then
closes the connection with RESOURCE_EXHAUSTED, aborting its requests. Meanwhile normal
clients get exactly their quiet-run output.
"""

from __future__ import annotations

import asyncio
import queue

import grpc
from tandem.v1 import engine_core_pb2, engine_core_pb2_grpc, generation_pb2_grpc

from tests.faults.probes import (
    MAX_MODEL_LEN,
    busy,
    engine_stats,
    leaked_blocks,
    quiet_run,
    random_prompts,
    server_in_flight,
    token_request,
    wait_for,
)

# A reader that never reads: the smallest stream window and no BDP probing to grow it.
STALLED_CHANNEL_OPTIONS = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
MAX_UNSENT_TOKENS = 16


def read_all(call) -> grpc.RpcError | None:
    """Drain a stalled call now; the error it ended with (None: it ended OK)."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as e:
        return e
    return None


async def survivors_equal_quiet_run(address: str, requests: list, expected: list) -> None:
    assert await quiet_run(address, requests) == expected


def test_a_stalled_client_is_cut_off_by_the_frontend(stack, idle_after, report):
    frontend = stack.add_frontend("--max-unsent-tokens", str(MAX_UNSENT_TOKENS), name="frontend-slow")
    survivors = [token_request(p, 32) for p in random_prompts(3, seed=21)]
    expected = asyncio.run(quiet_run(frontend.address, survivors))
    stalled_channel = grpc.insecure_channel(frontend.address, options=STALLED_CHANNEL_OPTIONS)
    try:
        stub = generation_pb2_grpc.GenerationServiceStub(stalled_channel)
        stalled = [stub.Generate(token_request(p, MAX_MODEL_LEN - 60), timeout=120)
                   for p in random_prompts(4, seed=22)]
        report.fault("stalled client stream", len(stalled))
        asyncio.run(survivors_equal_quiet_run(frontend.address, survivors, expected))
        report.requests += 2 * len(survivors)
        # while the stalled clients still read nothing, their requests are gone from frontend and engine
        wait_for(lambda: server_in_flight(frontend.address) == 0, what="the frontend to cut off stalled streams")
        wait_for(lambda: busy(engine_stats(stack.engine.address)) == 0, what="the engine to drop stalled requests")
        errors = [read_all(call) for call in stalled]
    finally:
        stalled_channel.close()
        frontend.stop()
    for error in errors:
        report.status(error.code() if error else grpc.StatusCode.OK)
    assert all(e is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors), errors
    assert "--max-unsent-tokens" in errors[0].details()


def test_a_stalled_engine_connection_is_closed_by_the_engine(stack, idle_after, report):
    frontend = stack.frontends[0]
    survivors = [token_request(p, 32) for p in random_prompts(3, seed=23)]
    expected = asyncio.run(quiet_run(frontend.address, survivors))
    inputs: queue.Queue = queue.Queue()
    channel = grpc.insecure_channel(stack.engine.address, options=STALLED_CHANNEL_OPTIONS)
    try:
        stalled = engine_core_pb2_grpc.EngineCoreServiceStub(channel).Connect(iter(inputs.get, None), timeout=120)
        for i, prompt in enumerate(random_prompts(4, seed=24)):
            inputs.put(engine_core_pb2.EngineCoreInput(add=engine_core_pb2.EngineCoreRequest(
                request_id=f"stalled-{i}", prompt_token_ids=prompt,
                sampling_params=dict(max_tokens=MAX_MODEL_LEN - 60, temperature=0.0, ignore_eos=True))))
        for call_id in range(1, 400):  # each answer is one more message the stalled client does not read
            inputs.put(engine_core_pb2.EngineCoreInput(utility=engine_core_pb2.UtilityCall(
                call_id=call_id, get_stats=engine_core_pb2.GetStatsCall())))
        report.fault("stalled engine connection")
        asyncio.run(survivors_equal_quiet_run(frontend.address, survivors, expected))
        report.requests += 2 * len(survivors)
        stats = wait_for(lambda: (s := engine_stats(stack.engine.address)) and busy(s) == 0 and s,
                         what="the engine to abort the stalled connection's requests")
        assert leaked_blocks(stats) == 0
        error = read_all(stalled)
    finally:
        inputs.put(None)
        channel.close()
    report.status(error.code() if error else grpc.StatusCode.OK)
    assert error is not None and error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
    assert "--max-pending-outputs" in error.details()

