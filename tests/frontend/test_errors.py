"""Bad input, limits and cancellation: each gets its status code and a message naming the field."""

from __future__ import annotations

import math

import grpc
import pytest
from tandem.v1 import common_pb2, generation_pb2

from tests.frontend.conftest import wait_until

SP = common_pb2.SamplingParams
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def text(sampling: common_pb2.SamplingParams, prompt: str = "hello") -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text=prompt, sampling_params=sampling)


def ids(token_ids: list[int]) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=token_ids))


BAD_REQUESTS = [
    (text(SP(n=0)), "n must be in [1, 16]"),
    (text(SP(n=17)), "n must be in [1, 16]"),
    (text(SP(temperature=-1)), "temperature must be >= 0"),
    (text(SP(temperature=math.nan)), "temperature"),
    (text(SP(top_p=0)), "top_p must be in (0, 1]"),
    (text(SP(top_k=-2)), "top_k"),
    (text(SP(min_p=1.5)), "min_p must be in [0, 1]"),
    (text(SP(max_tokens=0)), "max_tokens must be >= 1"),
    (text(SP(min_tokens=5, max_tokens=2)), "min_tokens must be <= max_tokens"),
    (text(SP(presence_penalty=3)), "presence_penalty must be in [-2, 2]"),
    (text(SP(frequency_penalty=-2.5)), "frequency_penalty must be in [-2, 2]"),
    (text(SP(repetition_penalty=0)), "repetition_penalty must be in (0, 2]"),
    (text(SP(logit_bias={10**7: 1.0})), "logit_bias key 10000000 is not in the vocabulary"),
    (text(SP(logit_bias={5: 200.0})), "logit_bias[5] must be in [-100, 100]"),
    (text(SP(logprobs=21)), "logprobs must be in [0, 20]"),
    (text(SP(prompt_logprobs=-1)), "prompt_logprobs must be in [0, 20]"),
    (text(SP(stop=["ok", ""])), "stop[1] is empty"),
    (text(SP(stop=["x"] * 17)), "sampling_params.stop has 17 strings; at most 16"),
    (text(SP(stop_token_ids=[-1])), "stop_token_ids[0] -1 is not in the vocabulary"),
    (text(SP(output_kind=9)), "output_kind"),
    (text(SP(), prompt=""), "prompt text is empty"),
    (generation_pb2.GenerateRequest(), "prompt is missing"),
    (ids([]), "prompt token_ids is empty"),
    (ids([1, 10**7]), "prompt token_ids[1] = 10000000 is out of range"),
    (ids([1] * 2048), "prompt has 2048 tokens, max_model_len is 2048"),
    # max_tokens beyond the room the prompt leaves is refused with the numbers, never cut silently
    (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[1] * 2040),
                                    sampling_params=SP(max_tokens=50)),
     "maximum context length is 2048 tokens and the prompt has 2040, so at most 8 can be generated; you requested 50"),
    (text(SP(max_tokens=2**31 - 1)), "sampling_params.max_tokens is too large"),
]


@pytest.mark.parametrize(("request_", "message"), BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_input_is_invalid_argument_naming_the_field(stack, request_, message):
    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stack.stub.Generate(request_)]
        return error.value

    error = stack.run(run())
    assert error.code() == INVALID
    assert message in error.details()


@pytest.mark.parametrize(("messages", "message"), [
    ([], "messages is empty"),
    ([generation_pb2.ChatMessage(role="wizard", content="hi")], "messages[0].role must be one of"),
])
def test_bad_chat_is_invalid_argument(stack, messages, message):
    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in stack.stub.Chat(generation_pb2.ChatRequest(messages=messages))]
        return error.value

    error = stack.run(run())
    assert (error.code(), message in error.details()) == (INVALID, True)


def test_server_stays_up_after_bad_input(stack):
    async def run():
        return [r async for r in stack.stub.Generate(text(SP(max_tokens=3)))]

    assert stack.run(run())[-1].usage.completion_tokens == 3


def slow(request_id: str = "", **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(request_id=request_id, text="a long story",
                                          sampling_params=SP(max_tokens=1000, **sampling))


def test_duplicate_in_flight_request_id_is_already_exists(make_stack):
    s = make_stack(step_delay_s=0.02)

    async def run():
        first = s.stub.Generate(slow("dup"))
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in s.stub.Generate(slow("dup"))]
        first.cancel()
        return error.value

    error = s.run(run())
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS and "'dup' is already in flight" in error.details()


def test_admission_limit_is_resource_exhausted(make_stack):
    s = make_stack(step_delay_s=0.02, max_waiting_requests=3)

    async def run():
        calls = [s.stub.Generate(slow()) for _ in range(3)]
        for call in calls:
            await call.read()
        errors = []
        for request in (slow(), slow(n=2)):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                [r async for r in s.stub.Generate(request)]
            errors.append(error.value)
        for call in calls:
            call.cancel()
        await wait_until(lambda: s.llm.output_processor.num_requests == 0)
        after = [r async for r in s.stub.Generate(text(SP(n=3, max_tokens=2)))]
        return errors, after

    errors, after = s.run(run())
    for error in errors:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the limit is 3 (--max-waiting-requests)" in error.details()
    assert after[-1].usage.completion_tokens == 6


def test_client_cancel_aborts_in_the_engine(make_stack):
    s = make_stack(step_delay_s=0.01)

    async def run():
        call = s.stub.Generate(slow("cancel-me"))
        await call.read()
        call.cancel()
        await wait_until(lambda: "cancel-me" in s.engine.aborted)

    s.run(run())
    assert s.llm.output_processor.num_requests == 0 and s.client.num_in_flight == 0


def test_deadline_aborts_in_the_engine(make_stack):
    s = make_stack(step_delay_s=0.01)

    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [r async for r in s.stub.Generate(slow("late", n=2), timeout=0.3)]
        await wait_until(lambda: {"0_late", "1_late"} <= set(s.engine.aborted))
        return error.value

    assert s.run(run()).code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert s.llm.output_processor.num_requests == 0


def test_abort_rpc_ends_the_stream_with_abort(make_stack):
    s = make_stack(step_delay_s=0.01)

    async def run():
        call = s.stub.Generate(slow("victim"))
        await call.read()
        response = await s.stub.Abort(generation_pb2.AbortRequest(request_ids=["victim", "unknown"]))
        rest = []
        while (message := await call.read()) is not grpc.aio.EOF:
            rest.append(message)
        await wait_until(lambda: "victim" in s.engine.aborted)  # the stream ends first; the engine hears next
        return response, rest

    response, rest = s.run(run())
    assert list(response.aborted_request_ids) == ["victim"]
    assert rest[-1].completions[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
