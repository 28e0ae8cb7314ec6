"""SubscribeKvEvents against the real engine: the blocks a prompt fills reach a subscriber with their token ids,
in the protocol smg reads (a real engine's prefix cache, not the fake's)."""

from __future__ import annotations

import asyncio
import itertools

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.event_loops import close_loop
from tests.waits import STATE_TIMEOUT_S

_RUNS = itertools.count()


def test_a_prompts_blocks_reach_a_subscriber_with_their_tokens(gateway_stack):
    # two full 16-token blocks (the last token is never cached as a full block), new to the shared stack's cache
    # on every run: a prompt cached by an earlier run (make test-shake repeats tests) stores no block
    first_token = 1000 + 40 * next(_RUNS)
    prompt = list(range(first_token, first_token + 40))

    async def run():
        async with grpc.aio.insecure_channel(gateway_stack.frontend_address) as channel:
            stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
            events = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest())
            snapshot = await events.read()
            assert snapshot.events[0].WhichOneof("data") == "cleared" and snapshot.HasField("load")
            request = vllm_engine_pb2.GenerateRequest(
                request_id="kv-events", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=prompt), stream=False,
                sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2, temperature=0))
            [response] = [r async for r in stub.Generate(request)]
            assert response.complete.finish_reason
            stored = {}
            # load reports keep coming: bound the wait itself
            deadline = asyncio.get_running_loop().time() + STATE_TIMEOUT_S
            while len(stored) < 2:
                assert asyncio.get_running_loop().time() < deadline, f"blocks stored so far: {stored}"
                batch = await asyncio.wait_for(events.read(), STATE_TIMEOUT_S)
                assert batch.sequence_number >= 1 and batch.HasField("load")
                for event in batch.events:
                    for block in (event.stored.blocks if event.WhichOneof("data") == "stored" else []):
                        stored[tuple(block.token_ids)] = (block.block_hash, event.stored.parent_block_hash,
                                                          block.block_size)
            events.cancel()
            return stored

    loop = asyncio.new_event_loop()
    try:
        stored = loop.run_until_complete(run())
    finally:
        close_loop(loop)
    first, second = tuple(prompt[:16]), tuple(prompt[16:32])
    assert first in stored and second in stored
    assert stored[second][1] == stored[first][0] and stored[first][2] == 16
