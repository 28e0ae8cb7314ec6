"""SubscribeKvEvents against the real engine: the blocks a prompt fills reach a subscriber with their token ids,
in the protocol smg reads (a real engine's prefix cache, not the fake's)."""

from __future__ import annotations

import asyncio

import grpc
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.event_loops import close_loop


def test_a_prompts_blocks_reach_a_subscriber_with_their_tokens(gateway_stack):
    prompt = list(range(1000, 1040))  # two full 16-token blocks (the last token is never cached as a full block)

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
            while len(stored) < 2:
                batch = await asyncio.wait_for(events.read(), 10)
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
