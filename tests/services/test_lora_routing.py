"""Adapter-aware routing over real engine servers (tiny model): an adapter's requests go only to the engines
that announced it (EngineState), and among those to the one holding the prompt's blocks under that adapter;
the same prompt under another adapter or none starts cold. The engines' KV events name each block's adapter."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest

from engine_core.config import LoraConfig
from engine_core.protocol import EngineCoreRequest, SamplingParams, hash_prompt_blocks
from services.frontend.engines.grpc_client import GrpcEngineClient
from services.frontend.engines.router import Router, RoutingPolicy
from services.frontend.errors import NotFound
from tests.engine_core.tiny_lora import write_tiny_adapter
from tests.services.conftest import BLOCK_SIZE, ServerThread, tiny_engine_config
from tests.services.test_prefix_routing import wait_until

_RUNS = itertools.count()  # the engines live for the module: each run (make test-shake repeats) a prompt new to them


def fresh_prompt() -> list[int]:
    """4 full blocks of 4 and one token, that no earlier run cached."""
    start = 3 + 17 * next(_RUNS)
    return [token % 250 + 3 for token in range(start, start + 17)]


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tmp_path_factory):
    """Engine 0 has adapters x and y; engine 1 serves LoRA but has none loaded."""
    folders = {name: write_tiny_adapter(tiny_model_dir, tmp_path_factory.mktemp(f"route-{name}"), rank=4, seed=seed,
                                        target_modules=["q_proj", "v_proj"]) for name, seed in (("x", 1), ("y", 2))}
    configs = [dataclasses.replace(tiny_engine_config(tiny_model_dir), lora=LoraConfig(
        enable=True, max_loras=2, adapters={name: str(folder) for name, folder in loaded.items()}))
        for loaded in (folders, {})]
    servers = [ServerThread(config) for config in configs]
    yield servers
    for server in servers:
        server.shutdown()


def test_adapter_requests_go_to_engines_that_have_it_and_hit_its_prefix(engines):
    with_adapters, without = (server.target for server in engines)
    prompt = fresh_prompt()

    async def run():
        client = GrpcEngineClient([with_adapters, without], router=Router(RoutingPolicy.PREFIX_AWARE),
                                  backoff_initial_s=0.05)
        await client.start()
        try:
            await wait_until(lambda: {e.address: e.state.lora_names for e in client.engines() if e.connected}
                             == {with_adapters: ("x", "y"), without: ()})

            async def run_one(request_id, lora_name):
                request = EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=2, temperature=0.0), 0.0,
                                            lora_name=lora_name)
                client.add_request(request)
                engine = next(e.address for e in client._engines.values() if request_id in e.in_flight)
                while True:
                    outputs = await client.get_output()
                    assert not outputs.failed, outputs.error
                    done = [o for o in outputs.outputs if o.request_id == request_id and o.finish_reason]
                    if done:
                        return engine, done[0].num_cached_tokens

            first = await run_one("x-1", "x")
            again = await run_one("x-2", "x")
            other = await run_one("y-1", "y")
            assert first == (with_adapters, 0) and again == (with_adapters, 16)  # routed by the adapter's hashes
            assert other == (with_adapters, 0)  # the same prompt under another adapter shares no block
            base_engine, _ = await run_one("base-1", None)
            # the engine's KV events named each block's adapter; the frontend's view of the engine keeps them
            prefixes = {e.address: e.load.prefix for e in client._engines.values()}
            hashes = {name: hash_prompt_blocks(prompt, BLOCK_SIZE, lora_name=name) for name in (None, "x", "y")}
            await wait_until(lambda: set(hashes[None]) <= prefixes[base_engine].cached)
            # (an earlier run's blocks may still be cached beside this run's: count at least this run's 4 each)
            assert {name: count >= 4 for name, count in prefixes[with_adapters].cached_loras().items()} == {
                "x": True, "y": True}
            assert {h: prefixes[with_adapters].lora_of[h] for h in hashes["x"] + hashes["y"]} == {
                **dict.fromkeys(hashes["x"], "x"), **dict.fromkeys(hashes["y"], "y")}
            assert not set(hashes[None]) & set(prefixes[base_engine].lora_of)  # base blocks name no adapter
            snapshot = prefixes[with_adapters].snapshot()  # what a report listener added now starts from
            assert set(snapshot.stored_lora) == {"x", "y"}
            assert all(set(hashes[name]) <= set(snapshot.stored_lora[name]) for name in ("x", "y"))
            with pytest.raises(NotFound, match="'z'"):
                client.add_request(EngineCoreRequest("z-1", prompt, SamplingParams(max_tokens=2), 0.0, lora_name="z"))
        finally:
            await client.close()

    asyncio.run(run())
