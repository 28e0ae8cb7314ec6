"""Engine discovery: --engine targets, re-resolution, and the client adding and retiring engines (fake engines)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from engine_core.protocol import EngineCoreRequest, SamplingParams
from services.frontend.engines.discovery import (
    EngineDiscovery,
    EngineTarget,
    SystemResolver,
    parse_engine_target,
    parse_engine_targets,
)
from services.frontend.engines.grpc_client import GrpcEngineClient
from tests.frontend.conftest import wait_until
from tests.frontend.fake_engine import start_fake_engine


class ChangingResolver:
    """Answers what the test last set; raises OSError while `failing`; counts lookups."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses, self.failing, self.lookups = list(addresses), False, 0

    async def resolve(self, host: str, port: int) -> list[str]:
        self.lookups += 1
        if self.failing:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.addresses)


# ---- targets --------------------------------------------------------------------------
def test_targets_parse_plain_dns_ipv6_and_lists():
    assert parse_engine_target("127.0.0.1:50061") == EngineTarget("127.0.0.1", 50061)
    assert parse_engine_target("dns:///tandem-engine.prod.svc:50061") == EngineTarget("tandem-engine.prod.svc", 50061,
                                                                                      dns=True)
    assert parse_engine_target("dns:engines:7") == EngineTarget("engines", 7, dns=True)
    assert parse_engine_target("[::1]:50061").address == "[::1]:50061"
    assert str(parse_engine_target("dns:///e:1")) == "dns:///e:1"
    assert [t.address for t in parse_engine_targets(["a:1,b:2", "dns:///c:3"])] == ["a:1", "b:2", "c:3"]
    for bad in ("engine", "engine:", "engine:port", "dns://8.8.8.8/engine:1", ":50061", "e:70000"):
        with pytest.raises(ValueError, match="engine target"):
            parse_engine_target(bad)


def test_the_system_resolver_returns_every_address_with_the_port():
    addresses = asyncio.run(SystemResolver().resolve("localhost", 50061))
    assert "127.0.0.1:50061" in addresses or "[::1]:50061" in addresses


# ---- discovery ------------------------------------------------------------------------
def test_discovery_follows_the_answer_keeps_it_on_failure_and_refreshes_on_demand():
    async def run():
        changes = []
        resolver = ChangingResolver(["10.0.0.1:50061", "10.0.0.2:50061"])
        targets = parse_engine_targets(["dns:///engines:50061", "10.9.9.9:1"])
        discovery = EngineDiscovery(targets, changes.append, resolver=resolver, interval_s=3600)
        await discovery.start()
        try:
            resolver.addresses = ["10.0.0.2:50061", "10.0.0.3:50061"]
            discovery.refresh()  # the interval is an hour: only refresh() can look again
            await wait_until(lambda: len(changes) == 2)
            resolver.failing = True
            lookups = resolver.lookups
            discovery.refresh()
            await wait_until(lambda: resolver.lookups > lookups)
            await asyncio.sleep(0.05)
            return changes, discovery.addresses, discovery.names
        finally:
            await discovery.close()

    changes, addresses, names = asyncio.run(run())
    assert changes == [["10.0.0.1:50061", "10.0.0.2:50061", "10.9.9.9:1"],
                       ["10.0.0.2:50061", "10.0.0.3:50061", "10.9.9.9:1"]]
    assert addresses == changes[-1], "a failed lookup keeps the last answer"
    assert names["10.0.0.3:50061"] == "engines" and "10.9.9.9:1" not in names


def test_discovery_resolves_on_its_interval():
    async def run():
        resolver = ChangingResolver(["10.0.0.1:1"])
        discovery = EngineDiscovery(parse_engine_targets(["dns:///e:1"]), lambda _: None, resolver=resolver,
                                    interval_s=0.02)
        await discovery.start()
        try:
            await wait_until(lambda: resolver.lookups >= 4)
        finally:
            await discovery.close()

    asyncio.run(run())
    with pytest.raises(ValueError, match="interval"):
        EngineDiscovery([], lambda _: None, interval_s=0)


# ---- the client: engines added and retired ------------------------------------------------
def request(request_id: str, max_tokens: int, first_token: int = 1) -> EngineCoreRequest:
    prompt = list(range(first_token, first_token + 39))
    return EngineCoreRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0)


def test_client_connects_new_engines_and_retires_departed_ones_after_their_requests():
    async def run():
        engines = [await start_fake_engine(step_delay_s=0.005) for _ in range(3)]
        addresses = [f"127.0.0.1:{port}" for _, port, _ in engines]
        resolver = ChangingResolver(addresses[:2])
        client = GrpcEngineClient(["dns:///tandem-engine.test.svc:50061"], resolver=resolver,
                                  resolve_interval_s=3600, backoff_initial_s=0.05)
        finished: dict[str, str] = {}

        async def collect():
            while True:
                outputs = await client.get_output()
                for output in outputs.outputs:
                    if output.finish_reason is not None:
                        finished[output.request_id] = output.finish_reason.name
                for request_id in outputs.failed:
                    finished[request_id] = f"failed: {outputs.error}"

        collector = asyncio.create_task(collect())
        await client.start()
        try:
            await wait_until(lambda: sum(e.connected for e in client.engines()) == 2)
            for i in range(4):  # long requests, distinct prompts: spread by load
                client.add_request(request(f"long-{i}", 300, first_token=100 * i + 1))
            await wait_until(lambda: sum(len(e[2].added) for e in engines) == 4)
            on_first = list(engines[0][2].added)
            resolver.addresses = addresses[1:]  # engine 0 leaves, engine 2 arrives
            client._discovery.refresh()
            await wait_until(lambda: any(e.address == addresses[2] and e.connected for e in client.engines()))
            assert any(e.address == addresses[0] for e in client.engines()), "retiring, not gone: requests in flight"
            for i in range(6):
                client.add_request(request(f"new-{i}", 3))
            await wait_until(lambda: len(finished) == 10, timeout_s=15)
            await wait_until(lambda: all(e.address != addresses[0] for e in client.engines()))
            return on_first, finished, [set(e[2].added) for e in engines]
        finally:
            collector.cancel()
            await client.close()
            for server, _, _ in engines:
                await server.stop(0)

    on_first, finished, added = asyncio.run(run())
    assert len(on_first) == 2 and set(finished.values()) == {"LENGTH"}, finished  # none failed
    assert added[0] == set(on_first), "no new request went to the retiring engine"
    assert {f"new-{i}" for i in range(6)} <= added[1] | added[2] and added[2]


def test_an_engine_back_in_the_answer_is_routed_to_again_and_the_router_metrics_show():
    from services.telemetry.metrics import FrontendMetrics

    async def run():
        engines = [await start_fake_engine(step_delay_s=0.005) for _ in range(2)]
        addresses = [f"127.0.0.1:{port}" for _, port, _ in engines]
        resolver = ChangingResolver(addresses)
        metrics = FrontendMetrics("fake")
        client = GrpcEngineClient(["dns:///e.test.svc:1"], resolver=resolver, resolve_interval_s=3600,
                                  backoff_initial_s=0.05, metrics=metrics)
        await client.start()
        try:
            await wait_until(lambda: all(e.connected for e in client.engines()) and len(client.engines()) == 2)
            client.add_request(request("held", 10_000))  # stays in flight on its engine
            await wait_until(lambda: sum(len(e[2].added) for e in engines) == 1)
            holder = next(i for i, e in enumerate(engines) if e[2].added)
            resolver.addresses = [addresses[1 - holder]]
            client._discovery.refresh()
            await wait_until(lambda: client._engines[addresses[holder]].retiring)
            while_retiring = [e.address for e in client._engines.values() if e.routable]
            resolver.addresses = addresses
            client._discovery.refresh()
            await wait_until(lambda: not client._engines[addresses[holder]].retiring)
            gauge = {s.labels["engine"]: s.value for s in metrics.registry.collect()
                     for s in s.samples if s.name == "tandem:router_requests_in_flight"}
            client.add_request(request("same-prompt", 2))  # the held request's prompt: expected on its engine
            await wait_until(lambda: "same-prompt" in engines[holder][2].added)
            hits = metrics.registry.get_sample_value("tandem:router_prefix_hit_tokens_total",
                                                     {"policy": "prefix-aware"})
            client.abort(["held"])
            return addresses[1 - holder], while_retiring, gauge, hits
        finally:
            await client.close()
            for server, _, _ in engines:
                await server.stop(0)

    other, while_retiring, gauge, hits = asyncio.run(run())
    assert while_retiring == [other], "while retiring, only the other engine takes requests"
    assert sorted(gauge.values()) == [0.0, 1.0]
    assert hits == 32, "two full blocks of 16 of the 39-token prompt were expected on the chosen engine"
