"""The engine link: loss and reconnection, health, admin calls forwarded as utility calls, info RPCs."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tandem.v1 import admin_pb2, common_pb2, generation_pb2

from tests.frontend.conftest import wait_until

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def req(request_id="", max_tokens=1000) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(request_id=request_id, text="hello engine",
                                          sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens))


@contextlib.asynccontextmanager
async def two_engines(tokenizer):
    """Two fake engines, one GrpcEngineClient connected to both, an AsyncLLM over it: (engines, client, llm)."""
    from services.frontend.async_llm import AsyncLLM
    from services.frontend.engines.grpc_client import GrpcEngineClient
    from tests.frontend.fake_engine import start_fake_engine

    engines = [await start_fake_engine(step_delay_s=0.01, vocab_size=tokenizer.vocab_size) for _ in range(2)]
    client = GrpcEngineClient([f"127.0.0.1:{port}" for _, port, _ in engines], backoff_initial_s=0.05)
    await client.start()
    try:
        await wait_until(lambda: all(e.connected for e in client.engines()))
        yield engines, client, AsyncLLM(client, tokenizer)
    finally:
        await client.close()
        for server, _, _ in engines:
            await server.stop(0)


async def wait_for_health(stack, status) -> None:
    for _ in range(500):
        if await stack.health_status() == status:
            return
        await asyncio.sleep(0.01)
    pytest.fail(f"health never became {status}")


def test_engine_loss_fails_streams_flips_health_and_reconnects(make_stack):
    s = make_stack(step_delay_s=0.01)
    address = f"127.0.0.1:{s.engine_port}"

    async def run():
        assert await s.health_status() == SERVING
        calls = [s.stub.Generate(req(f"lost-{i}")) for i in range(3)]
        for call in calls:
            await call.read()
        await s.engine_server.stop(0)
        errors = []
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                while await call.read() is not grpc.aio.EOF:
                    pass
            errors.append(error.value)
        await wait_for_health(s, NOT_SERVING)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in s.stub.Generate(req(max_tokens=2))]
        await s.start_engine(address)  # the engine comes back on the same port
        await wait_for_health(s, SERVING)
        served = [r async for r in s.stub.Generate(req(max_tokens=2))]
        return errors, refused.value, served

    errors, refused, served = s.run(run())
    for error in errors:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert f"engine at {address} disconnected" in error.details()
    assert refused.code() == grpc.StatusCode.UNAVAILABLE and "no engine is connected" in refused.details()
    assert served[-1].usage.completion_tokens == 2
    assert s.engine.num_connections == 2 and s.client.num_in_flight == 0


def test_requests_spread_over_engines_least_loaded_first(tokenizer):
    """Two engines: requests alternate by load; losing one leaves the other serving."""

    from engine_core.protocol import SamplingParams
    from services.frontend.input_processor import TextPrompt

    async def run():
        async with two_engines(tokenizer) as (engines, client, llm):
            for i in range(4):
                llm.add_request(TextPrompt("hi"), SamplingParams(max_tokens=1000), f"r{i}")
            loads = [e.num_in_flight for e in client.engines()]
            await engines[0][0].stop(0)
            await wait_until(lambda: not client.engines()[0].connected)
            return loads, client.is_connected, client.num_in_flight

    loads, connected, in_flight = asyncio.run(run())
    assert loads == [2, 2] and connected and in_flight == 2


def test_new_requests_go_around_paused_engines_and_never_to_a_sleeping_one(tokenizer):
    """Two engines: a paused one gets nothing while the other admits, and requests wait there only when every
    awake engine is paused; when every engine sleeps a request is UNAVAILABLE (the engines' state, not its fault)."""

    from engine_core.protocol import SamplingParams
    from services.frontend.errors import EngineAsleep
    from services.frontend.input_processor import TextPrompt

    async def run():
        async with two_engines(tokenizer) as (engines, client, llm):
            (_, _, first), (_, _, second) = engines

            async def tell(engine, index, **state):
                engine.announce(**state)
                said = state.get("paused", False), state.get("asleep", False)
                await wait_until(lambda: (client.engines()[index].state.paused,
                                          client.engines()[index].state.asleep) == said)

            def add(count: int) -> list[int]:
                for _ in range(count):
                    llm.add_request(TextPrompt("hi"), SamplingParams(max_tokens=1000))
                return [e.num_in_flight for e in client.engines()]

            await tell(first, 0, paused=True, pause_mode=common_pb2.PAUSE_MODE_KEEP)
            around = add(4), llm.serving
            await tell(second, 1, asleep=True)
            held = add(1), llm.serving, llm.not_serving_reason
            await tell(first, 0, asleep=True)
            with pytest.raises(EngineAsleep) as refused:
                add(1)
            asleep = llm.serving, llm.not_serving_reason, str(refused.value)
            await tell(first, 0)
            return around, held, asleep, add(1)

    around, held, asleep, awake = asyncio.run(run())
    assert around == ([0, 4], True)
    assert held[:2] == ([1, 4], False) and "paused" in held[2]
    assert asleep[0] is False and "asleep" in asleep[1] and "tandem admin wake" in asleep[2]
    assert awake == [2, 4]


def test_admin_calls_are_forwarded_as_utility_calls(stack):
    async def run():
        before = len(stack.engine.utility_calls)
        responses = [
            await stack.admin.Pause(admin_pb2.PauseRequest(mode=common_pb2.PAUSE_MODE_WAIT)),
            await stack.admin.Resume(admin_pb2.ResumeRequest()),
            await stack.admin.Sleep(admin_pb2.SleepRequest()),
            await stack.admin.WakeUp(admin_pb2.WakeUpRequest()),
            await stack.admin.ResetPrefixCache(admin_pb2.ResetPrefixCacheRequest()),
            await stack.admin.StartProfile(admin_pb2.StartProfileRequest(output_dir="/tmp/prof")),
            await stack.admin.StopProfile(admin_pb2.StopProfileRequest()),
        ]
        return responses, stack.engine.utility_calls[before:]

    responses, calls = stack.run(run())
    assert all(r.ok for r in responses), responses
    assert [c.WhichOneof("call") for c in calls] == [
        "pause", "resume", "sleep", "wake_up", "reset_prefix_cache", "start_profile", "stop_profile"]
    assert not any(c.method for c in calls)  # the typed form only, never the deprecated one
    assert calls[0].pause.pause_mode == common_pb2.PAUSE_MODE_WAIT and calls[5].start_profile.profile_dir == "/tmp/prof"


def test_drain_stops_admission_until_resume(make_stack):
    s = make_stack()

    async def run():
        drained = await s.admin.Drain(admin_pb2.DrainRequest(timeout_s=1))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            [r async for r in s.stub.Generate(req(max_tokens=2))]
        await s.admin.Resume(admin_pb2.ResumeRequest())
        return drained, refused.value, [r async for r in s.stub.Generate(req(max_tokens=2))]

    drained, refused, served = s.run(run())
    assert drained.ok and refused.code() == grpc.StatusCode.UNAVAILABLE and "draining" in refused.details()
    assert served[-1].usage.completion_tokens == 2


def test_info_tokenize_detokenize_and_reflection(stack):
    tok = stack.tokenizer

    async def run():
        model = await stack.stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
        server = await stack.stub.GetServerInfo(generation_pb2.GetServerInfoRequest())
        tokens = await stack.stub.Tokenize(generation_pb2.TokenizeRequest(text="Hello there"))
        text = await stack.stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=tokens.token_ids))
        with pytest.raises(grpc.aio.AioRpcError) as bad:
            await stack.stub.Detokenize(generation_pb2.DetokenizeRequest(token_ids=[10**7]))
        reflection = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
        listed = [r async for r in reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
        return model, server, tokens, text, bad.value, listed

    model, server, tokens, text, bad, listed = stack.run(run())
    assert (model.max_model_len, model.vocab_size, model.has_chat_template) == (2048, tok.vocab_size, True)
    assert server.engines[0].connected and server.max_waiting_requests == 64
    assert list(tokens.token_ids) == tok.encode("Hello there") and tokens.max_model_len == 2048
    assert text.text == "Hello there"
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0]" in bad.details()
    services = {s.name for s in listed[0].list_services_response.service}
    assert {"tandem.v1.GenerationService", "tandem.v1.AdminService", "grpc.health.v1.Health"} <= services
