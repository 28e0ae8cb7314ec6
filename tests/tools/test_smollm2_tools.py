"""The embedded SmolLM2 over gRPC: for 240 hypothesis-made tool sets with tool_choice required (parallel
or one call) and named, streamed and not, n = 1 and 2, every call parses and validates against its tool's
schema, and every completion ends with FINISH_REASON_TOOL_CALLS (a call cut by max_tokens fails).
The requests go out together so the engine batches them."""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from tests.test_stack import Services
from tests.tools.tool_schemas import tool_sets

pytestmark = pytest.mark.slow  # the real SmolLM2 (make test-slow)

NUM_TOOL_SETS = 240
MAX_TOOL_CALLS = 3  # the frontend's --max-tool-calls: parallel arrays end within MAX_TOKENS
MAX_TOKENS = 800


@pytest.fixture(scope="module")
def smollm2_stack():
    services = Services(["--max-model-len", "4096", "--max-num-seqs", "64", "--log-level", "WARNING"],
                        ["--log-level", "WARNING", "--max-tool-calls", str(MAX_TOOL_CALLS)])
    yield services
    services.stop()


@st.composite
def cases(draw):
    """A tool set and how to ask for a call of it."""
    tools = draw(tool_sets)
    choice = draw(st.sampled_from(["required", "required_one", "named"]))
    request = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(role="user", content=f"Please use the {tools[0][0]} tool.")],
        tools=[generation_pb2.Tool(name=name, description=f"Does {word}.", parameters_json=json.dumps(schema))
               for name, word, schema in tools],
        sampling_params=common_pb2.SamplingParams(
            n=draw(st.sampled_from([1, 2])), temperature=0.7, seed=draw(st.integers(0, 1000)), max_tokens=MAX_TOKENS,
            output_kind=draw(st.sampled_from([common_pb2.OUTPUT_KIND_DELTA, common_pb2.OUTPUT_KIND_FINAL_ONLY]))))
    if choice == "named":
        request.tool_choice.function_name = draw(st.sampled_from([name for name, _, _ in tools]))
    else:
        request.tool_choice.mode = generation_pb2.TOOL_CHOICE_MODE_REQUIRED
        request.parallel_tool_calls = choice == "required"
    return request


async def call(stub, request) -> list[generation_pb2.ChatResponse]:
    return [response async for response in stub.Chat(request, timeout=1800)]


async def call_all(address: str, requests) -> list:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        return await asyncio.gather(*(call(stub, r) for r in requests), return_exceptions=True)


def failures(request: generation_pb2.ChatRequest, responses) -> list[str]:
    """Why this request's calls do not pass (empty: they do)."""
    if isinstance(responses, Exception):
        return [f"the call failed: {responses!r}"]
    schemas = {t.name: json.loads(t.parameters_json) for t in request.tools}
    problems = []
    for index in range(request.sampling_params.n):
        chunks = [c for r in responses for c in r.completions if c.index == index]
        last = chunks[-1]
        if last.finish_reason != common_pb2.FINISH_REASON_TOOL_CALLS:
            problems.append(f"completion {index} ended {common_pb2.FinishReason.Name(last.finish_reason)}: "
                            f"{last.text!r} {list(last.tool_calls)}")
            continue
        calls = list(last.tool_calls)
        if request.tool_choice.function_name:
            expected = f"one call of {request.tool_choice.function_name}"
            if [c.name for c in calls] != [request.tool_choice.function_name]:
                problems.append(f"completion {index}: {expected}, got {[c.name for c in calls]}")
        elif not 1 <= len(calls) <= (MAX_TOOL_CALLS if request.parallel_tool_calls else 1):
            problems.append(f"completion {index}: {len(calls)} calls (parallel={request.parallel_tool_calls})")
        for c in calls:
            try:
                jsonschema.validate(json.loads(c.arguments_json), schemas[c.name])
            except (ValueError, KeyError, jsonschema.ValidationError) as e:
                problems.append(f"completion {index}: call {c.name}({c.arguments_json}) is invalid: {e}")
        if request.sampling_params.output_kind == common_pb2.OUTPUT_KIND_DELTA:
            streamed: dict[int, str] = {}
            for d in (d for chunk in chunks for d in chunk.tool_call_deltas):
                streamed[d.index] = streamed.get(d.index, "") + d.arguments_json
            if streamed != {c.index: c.arguments_json for c in calls}:
                problems.append(f"completion {index}: the deltas add up to {streamed}, not the calls {calls}")
    return problems


def _kind(request: generation_pb2.ChatRequest) -> str:
    choice = (f"named {request.tool_choice.function_name}" if request.tool_choice.function_name else
              "required" if request.parallel_tool_calls else "required one")
    kind = common_pb2.OutputKind.Name(request.sampling_params.output_kind)
    return f"{choice}, n={request.sampling_params.n}, {kind}"


def forced_requests(count: int) -> list[generation_pb2.ChatRequest]:
    """`count` hypothesis examples of cases(), collected (not run one by one) so they can go out together."""
    requests = []

    @settings(max_examples=count, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def collect(request):
        requests.append(request)

    collect()
    return requests


def test_forced_tool_calls_always_parse_and_validate(smollm2_stack):
    requests = forced_requests(NUM_TOOL_SETS)
    assert len(requests) >= 200
    results = asyncio.run(call_all(smollm2_stack.frontend_address, requests))
    problems = [f"request {i} ({_kind(r)}): {p}" for i, (r, out) in enumerate(zip(requests, results))
                for p in failures(r, out)]
    kinds = {(r.tool_choice.WhichOneof("choice"), r.parallel_tool_calls, r.sampling_params.n,
              r.sampling_params.output_kind) for r in requests}
    assert len(kinds) >= 12, kinds  # every combination of choice, n and output kind is in the run
    assert not problems, f"{len(problems)} of {len(requests)} requests failed:\n" + "\n".join(problems[:20])
