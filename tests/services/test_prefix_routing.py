"""Prefix-aware routing over real engine servers (tiny model): KV events -> the frontend's view -> cache hits.

Two engine cores and the frontend's GrpcEngineClient: a prompt's later requests go to the engine that
reported caching its blocks and hit its prefix cache there; a reset clears the frontend's view at once;
a frontend that connects later learns the cache from the stream's first message.
"""

from __future__ import annotations

import asyncio

import pytest

from engine_core.protocol import EngineCoreRequest, ResetPrefixCacheCall, SamplingParams
from engine_core.protocol.block_hash import hash_prompt_blocks
from services.frontend.engines.grpc_client import GrpcEngineClient
from services.frontend.engines.router import Router, RoutingPolicy
from tests.services.conftest import BLOCK_SIZE, ServerThread, tiny_engine_config

SYSTEM = list(range(3, 51))  # 12 blocks of 4


@pytest.fixture(scope="module")
def two_engines(tiny_model_dir):
    servers = [ServerThread(tiny_engine_config(tiny_model_dir)) for _ in range(2)]
    yield servers
    for server in servers:
        server.shutdown()


from tests.waits import wait_until  # noqa: E402, F401 (routing tests import it from here)


async def run_requests(client: GrpcEngineClient, prompts: dict[str, list[int]]) -> dict[str, int]:
    """Send every prompt at once; request id -> num_cached_tokens its engine reported."""
    cached: dict[str, int] = {}
    for request_id, prompt in prompts.items():
        client.add_request(EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=2, temperature=0.0), 0.0))
    while len(cached) < len(prompts):
        outputs = await client.get_output()
        assert not outputs.failed, outputs.error
        for output in outputs.outputs:
            if output.finish_reason is not None:
                cached[output.request_id] = output.num_cached_tokens
    return cached


def test_requests_follow_the_engine_holding_their_prefix(two_engines):
    targets = [server.target for server in two_engines]

    async def run():
        client = GrpcEngineClient(targets, router=Router(RoutingPolicy.PREFIX_AWARE), backoff_initial_s=0.05)
        await client.start()
        try:
            await wait_until(lambda: all(e.connected for e in client.engines()))
            await client.call_utility(ResetPrefixCacheCall())
            await run_requests(client, {"warm": SYSTEM + [60, 61]})
            hashes = hash_prompt_blocks(SYSTEM, BLOCK_SIZE)
            views = [e.load.prefix.cached for e in client._engines.values()]
            await wait_until(lambda: any(set(hashes) <= view for view in views))
            holder = next(i for i, view in enumerate(views) if set(hashes) <= view)
            hits = await run_requests(client, {f"user-{i}": SYSTEM + [70 + i, 71, 72] for i in range(4)})
            per_engine = [e.num_in_flight for e in client.engines()]

            # a frontend connecting now learns the cache from its first message (the snapshot)
            late = GrpcEngineClient(targets, backoff_initial_s=0.05)
            await late.start()
            try:
                await wait_until(lambda: any(set(hashes) <= e.load.prefix.cached for e in late._engines.values()))
            finally:
                await late.close()

            # the view is cleared with the answer, not a step later
            await client.call_utility(ResetPrefixCacheCall())
            cleared = [len(e.load.prefix.cached) for e in client._engines.values()]
            return holder, hits, per_engine, cleared
        finally:
            await client.close()

    holder, hits, per_engine, cleared = asyncio.run(run())
    assert all(cached == len(SYSTEM) for cached in hits.values()), hits  # every user hit the whole system prompt
    assert per_engine == [0, 0] and cleared == [0, 0]
    assert holder in (0, 1)


def test_round_robin_spreads_the_same_prompt_and_misses(two_engines):
    targets = [server.target for server in two_engines]

    async def run():
        client = GrpcEngineClient(targets, router=Router(RoutingPolicy.ROUND_ROBIN), backoff_initial_s=0.05)
        await client.start()
        try:
            await wait_until(lambda: all(e.connected for e in client.engines()))
            await client.call_utility(ResetPrefixCacheCall())
            first = await run_requests(client, {"rr-0": SYSTEM + [60], "rr-1": SYSTEM + [61]})
            return first
        finally:
            await client.call_utility(ResetPrefixCacheCall())
            await client.close()

    first = asyncio.run(run())
    assert first == {"rr-0": 0, "rr-1": 0}, "one on each engine: neither found the other's blocks"
