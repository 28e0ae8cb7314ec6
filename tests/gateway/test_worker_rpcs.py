"""The worker protocol's unary calls against the real engine (not the fake): Embed, GetLoads, GetServerInfo."""

from __future__ import annotations

import asyncio
import math

import grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from tests.event_loops import close_loop
from tests.test_stack import engine_stats


def call(address: str, method: str, request):
    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            return await getattr(vllm_engine_pb2_grpc.VllmEngineStub(channel), method)(request)
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(run())
    finally:
        close_loop(loop)


def test_embed_returns_the_models_unit_vector(gateway_stack):
    ids = [1200, 1201, 1202, 1203, 1204]
    response = call(gateway_stack.frontend_address, "Embed", vllm_engine_pb2.EmbedRequest(
        request_id="embed-1", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids)))
    assert response.prompt_tokens == len(ids) and response.embedding_dim == len(response.embedding) == 64
    assert math.isclose(math.sqrt(sum(v * v for v in response.embedding)), 1.0, rel_tol=1e-4)


def test_loads_and_server_info_describe_the_engine(gateway_stack):
    loads = call(gateway_stack.frontend_address, "GetLoads", vllm_engine_pb2.GetLoadsRequest())
    [load] = loads.loads
    total_blocks = engine_stats(gateway_stack.engine_address).num_total_blocks
    assert load.max_total_num_tokens == total_blocks * 16 and 0 <= load.token_usage <= 1 and loads.dp_rank_count == 1
    info = call(gateway_stack.frontend_address, "GetServerInfo", vllm_engine_pb2.GetServerInfoRequest())
    assert info.block_size == 16 and info.server_type == "tandem-grpc" and not info.is_paused
    assert info.uptime_seconds > 0
