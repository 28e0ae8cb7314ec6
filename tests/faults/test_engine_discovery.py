"""Engines found by DNS come and go under load: one added, one drained (SIGTERM), one killed (SIGKILL).

Four engine processes (tiny model); the frontend (in this process, so its resolver can be swapped)
targets `dns:///tandem-engine.faults.svc:50061`, whose answer is first engines a, b, c. With long
streams running on all three, c is killed, then the answer becomes a and d (b left, d arrived) and
b gets SIGTERM. What must hold: no stream on a or b fails (b's finish during its drain, as it
retires from routing), c's end UNAVAILABLE naming the engine (well inside their deadline), new
requests go only to a and d and all succeed, b exits 0, and the frontend ends with exactly a and d.
"""

from __future__ import annotations

import asyncio
import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from tandem.v1 import generation_pb2_grpc

from clients.local_stack import free_port
from engine_core.loader import default_model_path
from services.frontend.async_llm import AsyncLLM
from services.frontend.engines.grpc_client import GrpcEngineClient
from services.frontend.server import FrontendServer
from services.frontend.tokenizer import load_tokenizer
from tests.engine_core.tiny_models import write_tiny_model
from tests.faults.conftest import ENGINE_FLAGS
from tests.faults.probes import VOCAB, random_prompts, read_rest, token_request
from tests.faults.processes import ENGINE_STARTUP_S, Service
from tests.waits import STARTUP_TIMEOUT_S, wait_until

MAX_MODEL_LEN = 1024
LONG_TOKENS = 900  # long enough to be running through every change below
SHORT_TOKENS = 16
# a drain and a stream end when their work does; the bounds only turn a hang into a failure (tests/waits.py): on
# a loaded 2-core machine b's 900-token streams outlasted a 60 s drain grace (make test-shake, seed 8409)
STREAM_DEADLINE_S = STARTUP_TIMEOUT_S


class ChangingResolver:
    """The DNS answer the test sets (engines all listen on 127.0.0.1, so it names ports too)."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    async def resolve(self, host: str, port: int) -> list[str]:
        assert (host, port) == ("tandem-engine.faults.svc", 50061)
        return list(self.addresses)


@pytest.fixture  # fresh engines for each run: the test kills one and drains another (make test-shake repeats it)
def engines(tmp_path_factory):
    model = write_tiny_model(tmp_path_factory.mktemp("discovery-model"), vocab_size=VOCAB,
                             max_position_embeddings=MAX_MODEL_LEN)
    flags = ["--model", str(model), *ENGINE_FLAGS, "--max-model-len", str(MAX_MODEL_LEN),
             "--num-threads", "1", "--grace", str(int(STARTUP_TIMEOUT_S))]
    services = {name: Service(f"engine-{name}", "services.engine", free_port(), flags) for name in "abcd"}
    try:
        with ThreadPoolExecutor(len(services)) as pool:  # they load in parallel
            list(pool.map(lambda s: s.start(ENGINE_STARTUP_S), services.values()))
        yield services
    finally:
        for service in services.values():
            service.stop()


async def outcome(call, first_tokens: list[int]) -> tuple[str, int, str]:
    """(status code name, tokens streamed, details) of a call read to its end."""
    try:
        tokens = first_tokens + await read_rest(call)
    except grpc.aio.AioRpcError as e:
        return e.code().name, -1, e.details()
    return "OK", len(tokens), ""


def test_engines_added_drained_and_killed_behind_a_dns_name(engines, report):
    a, b, c, d = (engines[name] for name in "abcd")
    resolver = ChangingResolver([a.address, b.address, c.address])

    async def run():
        client = GrpcEngineClient(["dns:///tandem-engine.faults.svc:50061"], resolver=resolver,
                                  resolve_interval_s=0.2, backoff_initial_s=0.05, backoff_max_s=0.5)
        await client.start()
        llm = AsyncLLM(client, load_tokenizer(default_model_path()))
        frontend = FrontendServer(llm, "127.0.0.1:0")
        await frontend.start()
        connected = lambda: {e.address for e in client.engines() if e.connected}  # noqa: E731
        placed: dict[str, str] = {}  # the client's request id -> the engine it was sent to
        send = client.add_request

        def add_request(request):
            send(request)
            client_id = request.request_id.rpartition("@")[0]  # AsyncLLM's engine ids: "{request id}@{admission}"
            placed[client_id] = next(e.address for e in client._engines.values() if request.request_id in e.in_flight)

        client.add_request = add_request
        try:
            await wait_until(lambda: connected() == {a.address, b.address, c.address}, what="three engines")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{frontend.port}") as channel:
                stub = generation_pb2_grpc.GenerationServiceStub(channel)
                prompts = random_prompts(9, seed=161)  # distinct prompts: spread by load, three per engine
                calls = {f"long-{i}": stub.Generate(token_request(p, LONG_TOKENS, f"long-{i}"),
                                                    timeout=STREAM_DEADLINE_S) for i, p in enumerate(prompts)}
                firsts = {rid: list((await call.read()).completions[0].token_ids) for rid, call in calls.items()}
                ended = {rid: asyncio.ensure_future(outcome(call, firsts[rid])) for rid, call in calls.items()}

                c.kill()  # SIGKILL mid-stream
                report.fault("engine SIGKILL behind DNS")
                resolver.addresses = [a.address, d.address]  # b and c leave the answer, d arrives
                await wait_until(lambda: d.address in connected(), what="the new engine d")
                await wait_until(lambda: client._engines.get(b.address) is None or client._engines[b.address].retiring,
                                 what="b retiring")
                retiring_b = client._engines.get(b.address)
                b_in_flight_at_sigterm = len(retiring_b.in_flight) if retiring_b is not None else 0
                b.signal(signal.SIGTERM)  # drain: its streams finish, it takes no new work
                report.fault("engine SIGTERM behind DNS")

                short = [stub.Generate(token_request(p, SHORT_TOKENS), timeout=STREAM_DEADLINE_S)
                         for p in random_prompts(6, seed=162)]
                short_ends = [await outcome(call, []) for call in short]
                long_ends = {rid: await future for rid, future in ended.items()}
                engines_after = sorted(e.address for e in client.engines())
            return placed, long_ends, short_ends, b_in_flight_at_sigterm, engines_after
        finally:
            await frontend.stop(0)
            await llm.shutdown()
            await client.close()

    placed, long_ends, short_ends, b_in_flight, engines_after = asyncio.run(run())
    b_exit = b.process.wait(STARTUP_TIMEOUT_S)
    for code, _, _ in [*long_ends.values(), *short_ends]:
        report.status(getattr(grpc.StatusCode, code))

    by_engine = {addr: [rid for rid, where in placed.items() if where == addr and rid.startswith("long-")]
                 for addr in (a.address, b.address, c.address)}
    assert all(len(ids) == 3 for ids in by_engine.values()), by_engine
    later = [where for rid, where in placed.items() if not rid.startswith("long-")]
    assert len(later) == 6 and set(later) <= {a.address, d.address} and d.address in later, later
    for rid in by_engine[a.address] + by_engine[b.address]:
        assert long_ends[rid] == ("OK", LONG_TOKENS, ""), (rid, long_ends[rid])
    for rid in by_engine[c.address]:
        code, _, details = long_ends[rid]
        assert code == "UNAVAILABLE" and f"engine at {c.address} disconnected" in details, (rid, long_ends[rid])
    assert all(end == ("OK", SHORT_TOKENS, "") for end in short_ends), short_ends
    assert b_in_flight > 0, "b had streams to drain when it got SIGTERM (the test's premise)"
    assert b_exit == 0
    assert engines_after == sorted([a.address, d.address])
