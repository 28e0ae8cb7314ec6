"""The frontend refuses bad structured-output constraints itself: INVALID_ARGUMENT naming the field,
and the engine never sees the request. Good ones reach the engine intact."""

from __future__ import annotations

import grpc
import pytest
from tandem.v1 import common_pb2, generation_pb2

from engine_core.protocol import SamplingParams, StructuredOutput
from services.frontend.errors import InvalidRequest
from services.frontend.input_processor import TextPrompt
from services.frontend.limits import RequestLimits
from tests.frontend.test_generate import collect

BAD = [
    (common_pb2.StructuredOutput(json_schema='{"type": "string", "minLength": "x"}'), "structured.json_schema"),
    (common_pb2.StructuredOutput(json_schema="{not json"), "structured.json_schema is not valid JSON"),
    (common_pb2.StructuredOutput(regex="[a-"), "structured.regex does not compile"),
    (common_pb2.StructuredOutput(choice=common_pb2.Choice()), "structured.choice.options is empty"),
    (common_pb2.StructuredOutput(grammar="start: (("), "structured.grammar does not compile"),
    (common_pb2.StructuredOutput(regex="a" * 5000), "structured.regex is 5000 characters long"),
]


@pytest.mark.parametrize("constraint, message", BAD)
def test_bad_constraints_never_reach_the_engine(stack, constraint, message):
    request = generation_pb2.GenerateRequest(request_id=f"bad-{message[:20]}", text="hi", sampling_params=(
        common_pb2.SamplingParams(max_tokens=4, structured=constraint)))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(collect(stack, request))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"sampling_params.{message}"), info.value.details()
    assert not [r for r in stack.engine.added if r.startswith("bad-")]


def test_two_constraints_at_once_are_refused_by_name(stack):
    """The wire's oneof holds one; the shared type (in-process and offline callers) refuses two."""
    params = SamplingParams(structured=StructuredOutput(regex="a+", choice=("a", "b")))
    with pytest.raises(InvalidRequest, match=r"^sampling_params\.structured sets regex and choice"):
        stack.llm.input_processor.process("two", TextPrompt("hi"), params)


def test_a_good_constraint_reaches_the_engine_as_sent(stack):
    constraint = common_pb2.StructuredOutput(choice=common_pb2.Choice(options=["yes", "no"]), whitespace_flexible=True)
    request = generation_pb2.GenerateRequest(request_id="good-choice", text="hi", sampling_params=(
        common_pb2.SamplingParams(max_tokens=4, n=2, structured=constraint)))
    stack.run(collect(stack, request))
    for child in ("0_good-choice", "1_good-choice"):
        assert stack.engine.added[child].sampling_params.structured == constraint


def test_caps_come_from_the_limits():
    limits = RequestLimits(max_choices=2)
    with pytest.raises(ValueError, match=r"structured.choice.options has 3 options; at most 2 .*--max-choices"):
        limits.check_sampling(SamplingParams(structured=StructuredOutput(choice=("a", "b", "c"))))
