"""Drain, pause and sleep over the real servers: what health, GetServerInfo and new calls say in each state.

Readiness ("" and tandem.v1.GenerationService) turns NOT_SERVING while new requests would not start, so a
balancer or a readiness probe sends them elsewhere; tandem.v1.AdminService stays SERVING (the calls that end
the state must still get through, and a check on it must not restart the process).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import admin_pb2, common_pb2, generation_pb2

from engine_core.protocol import SleepCall
from tests.held_steps import steps_held_until, utility_call
from tests.waits import STATE_TIMEOUT_S

READINESS = ("", "tandem.v1.GenerationService")
ADMIN = "tandem.v1.AdminService"
PROMPT = [5, 6, 7, 8]


async def statuses(stack) -> dict[str, str]:
    health = health_pb2_grpc.HealthStub(stack.channel)
    found = {}
    for name in (*READINESS, ADMIN):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        found[name] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return found


def readiness(status: str) -> dict[str, str]:
    return {**dict.fromkeys(READINESS, status), ADMIN: "SERVING"}


async def until_readiness(stack, status: str, timeout_s: float = 10.0) -> dict[str, str]:
    """The health statuses once readiness says `status` (an engine's state reaches the frontend on its stream)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while (found := await statuses(stack)) != readiness(status):
        assert asyncio.get_running_loop().time() < deadline, found
        await asyncio.sleep(0.02)
    return found


async def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await call
    return refused.value.code(), refused.value.details()


async def until(condition, timeout_s: float = 10.0) -> None:
    """Wait for `condition()` (state another thread changes), failing after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the state never came"
        await asyncio.sleep(0.01)


async def read_to_end(call) -> list:
    """The responses left on a streaming call that was read with `read()` before (grpc forbids mixing iteration)."""
    responses = []
    while (response := await call.read()) is not grpc.aio.EOF:
        responses.append(response)
    return responses


async def server_info(stack) -> generation_pb2.GetServerInfoResponse:
    return await stack.stub.GetServerInfo(generation_pb2.GetServerInfoRequest(), timeout=10)


def test_drain_turns_readiness_not_serving_and_new_calls_unavailable_until_resume(make_stack):
    stack = make_stack()

    async def run():
        assert await statuses(stack) == readiness("SERVING")
        drained = await stack.admin.Drain(admin_pb2.DrainRequest(timeout_s=0), timeout=10)
        assert drained.ok and drained.detail == "drained"
        assert await statuses(stack) == readiness("NOT_SERVING")
        info = await server_info(stack)
        assert (info.draining, info.serving) == (True, False)
        code, details = await refusal(stack.generate(PROMPT, 2))
        assert code == grpc.StatusCode.UNAVAILABLE and "draining" in details and "another replica" in details

        assert (await stack.admin.Resume(admin_pb2.ResumeRequest(), timeout=10)).ok
        assert await statuses(stack) == readiness("SERVING")
        info = await server_info(stack)
        assert (info.draining, info.serving) == (False, True)
        assert (await stack.generate(PROMPT, 2))[-1].usage.completion_tokens == 2

    stack.run(run())


def test_pause_keep_holds_new_requests_until_resume_while_readiness_says_not_serving(make_stack):
    stack = make_stack()

    async def run():
        paused = await stack.admin.Pause(admin_pb2.PauseRequest(mode=common_pb2.PAUSE_MODE_KEEP), timeout=10)
        assert paused.ok, paused.detail
        await until_readiness(stack, "NOT_SERVING")
        (engine,) = (await server_info(stack)).engines
        assert (engine.paused, engine.pause_mode, engine.asleep) == (True, common_pb2.PAUSE_MODE_KEEP, False)
        held = asyncio.ensure_future(stack.generate(PROMPT, 3))  # waits in the engine, as vLLM and SGLang do
        pause = stack.engine.server.busy_loop._pause
        await until(lambda: len(pause.held) == 1)  # the engine has it, and holds it
        assert not held.done()

        assert (await stack.admin.Resume(admin_pb2.ResumeRequest(), timeout=10)).ok
        assert (await asyncio.wait_for(held, STATE_TIMEOUT_S))[-1].usage.completion_tokens == 3
        await until_readiness(stack, "SERVING")
        (engine,) = (await server_info(stack)).engines
        assert (engine.paused, engine.pause_mode) == (False, common_pb2.PAUSE_MODE_UNSPECIFIED)

    stack.run(run())


def test_sleep_turns_readiness_not_serving_and_new_calls_unavailable_until_wake_up(make_stack):
    stack = make_stack()

    async def run():
        assert (await stack.admin.Sleep(admin_pb2.SleepRequest(), timeout=30)).ok
        await until_readiness(stack, "NOT_SERVING")
        info = await server_info(stack)
        assert info.engines[0].asleep and not info.engines[0].paused and not info.serving
        for call in (stack.generate(PROMPT, 2),
                     stack.stub.Embed(generation_pb2.EmbedRequest(inputs=[generation_pb2.EmbedInput(text="hi")]))):
            code, details = await refusal(call)
            # a state of the server, not the caller's fault: UNAVAILABLE (HTTP 503 in vLLM), never INVALID_ARGUMENT
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert "asleep" in details and "tandem admin wake" in details

        assert (await stack.admin.WakeUp(admin_pb2.WakeUpRequest(), timeout=30)).ok
        await until_readiness(stack, "SERVING")
        assert (await stack.generate(PROMPT, 2))[-1].usage.completion_tokens == 2

    stack.run(run())


def test_bad_admin_input_gets_invalid_argument_naming_the_fix_and_the_server_stays_up(make_stack):
    stack = make_stack()

    async def run():
        for timeout_s in (-1.0, float("nan"), float("inf")):
            code, details = await refusal(stack.admin.Drain(admin_pb2.DrainRequest(timeout_s=timeout_s), timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "timeout_s must be a finite number" in details
        code, details = await refusal(stack.admin.Pause(admin_pb2.PauseRequest(mode=99), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "PAUSE_MODE_KEEP" in details
        code, details = await refusal(stack.admin.StartProfile(admin_pb2.StartProfileRequest(), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "output_dir" in details

        with steps_held_until(stack.engine.server.busy_loop, utility_call(SleepCall)):
            running = stack.stub.Generate(stack.generate_request(PROMPT, 60))
            await running.read()  # it runs, and cannot finish before the Sleep call reaches the engine
            refused = await stack.admin.Sleep(admin_pb2.SleepRequest(), timeout=30)  # an engine's refusal: ok = false
        assert not refused.ok and "in flight" in refused.detail
        assert (await asyncio.wait_for(read_to_end(running), STATE_TIMEOUT_S))[-1].usage.completion_tokens == 60
        assert await statuses(stack) == readiness("SERVING")  # nothing above changed the server's state
        assert (await stack.generate(PROMPT, 2))[-1].usage.completion_tokens == 2

    stack.run(run())
