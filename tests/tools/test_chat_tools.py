"""Chat with tools through the real frontend over gRPC (a scripted fake engine writes the model's text):
tool calls come out typed and streamed in every output kind and with n > 1, tool_choice becomes the
engine's constraint, and bad tools are refused before the engine sees the request."""

from __future__ import annotations

import json

import grpc
import pytest
from tandem.v1 import common_pb2, generation_pb2

from services.frontend.chat.template_choice import ChatSetup
from services.frontend.tools.choice_schema import required_calls_schema
from tests.frontend.test_generate import collect

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
SEARCH = {"type": "object", "properties": {"q": {"type": "string"}}}
TOOLS = [generation_pb2.Tool(name="get_weather", description="Weather for a city", parameters_json=json.dumps(WEATHER)),
         generation_pb2.Tool(name="search", parameters_json=json.dumps(SEARCH))]
MODEL_TEXT = ('Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
              '\n<tool_call>\n{"name": "search", "arguments": {"q": "rain"}}\n</tool_call>')
KINDS = [common_pb2.OUTPUT_KIND_DELTA, common_pb2.OUTPUT_KIND_CUMULATIVE, common_pb2.OUTPUT_KIND_FINAL_ONLY]


def chat(request_id: str, *, n: int = 1, kind: int = common_pb2.OUTPUT_KIND_DELTA,
         **fields) -> generation_pb2.ChatRequest:
    return generation_pb2.ChatRequest(
        request_id=request_id, messages=[generation_pb2.ChatMessage(role="user", content="Weather in Paris?")],
        tools=fields.pop("tools", TOOLS), sampling_params=common_pb2.SamplingParams(
            max_tokens=200, n=n, output_kind=kind, **fields.pop("sampling", {})), **fields)


def script(stack, request_id: str, text: str, n: int, steps=(1, 3, 7)) -> None:
    ids = stack.tokenizer.encode(text, add_special_tokens=False) + [stack.engine.eos_token_id]
    for i in range(n):
        stack.scripts[f"{i}_{request_id}" if n > 1 else request_id] = ids
        stack.steps[f"{i}_{request_id}" if n > 1 else request_id] = list(steps)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 2])
def test_tool_calls_stream_as_deltas_and_arrive_whole_in_the_last_message(stack, kind, n):
    request_id = f"calls-{kind}-{n}"
    script(stack, request_id, MODEL_TEXT, n)
    responses = stack.run(collect(stack, chat(request_id, n=n, kind=kind), rpc="Chat"))
    for index in range(n):
        chunks = [c for r in responses for c in r.completions if c.index == index]
        last = chunks[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
        calls = [(c.index, c.name, json.loads(c.arguments_json)) for c in last.tool_calls]
        assert calls == [(0, "get_weather", {"city": "Paris", "days": 2}), (1, "search", {"q": "rain"})]
        text = "".join(c.text for c in chunks) if kind == common_pb2.OUTPUT_KIND_DELTA else last.text
        assert text == "Checking."
        if kind == common_pb2.OUTPUT_KIND_DELTA:
            rebuilt: dict[int, dict] = {}
            for d in (d for c in chunks for d in c.tool_call_deltas):
                if d.index not in rebuilt:
                    assert d.id and d.name
                    rebuilt[d.index] = {"id": d.id, "name": d.name, "arguments": ""}
                else:
                    assert not d.id and not d.name
                rebuilt[d.index]["arguments"] += d.arguments_json
            assert rebuilt == {c.index: {"id": c.id, "name": c.name, "arguments": c.arguments_json}
                               for c in last.tool_calls}
        if kind == common_pb2.OUTPUT_KIND_CUMULATIVE:  # calls only grow
            counts = [len(c.tool_calls) for c in chunks]
            assert counts == sorted(counts)


def test_without_tools_nothing_is_parsed(stack):
    script(stack, "plain", MODEL_TEXT, 1)
    responses = stack.run(collect(stack, chat("plain", tools=[]), rpc="Chat"))
    assert "".join(c.text for r in responses for c in r.completions) == MODEL_TEXT
    assert responses[-1].completions[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_tool_choice_none_shows_and_parses_no_tools(stack):
    script(stack, "none", MODEL_TEXT, 1)
    request = chat("none", tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_NONE))
    responses = stack.run(collect(stack, request, rpc="Chat"))
    assert "".join(c.text for r in responses for c in r.completions) == MODEL_TEXT
    assert "get_weather" not in stack.tokenizer.decode(stack.engine.added["none"].prompt_token_ids)


def test_the_prompt_lists_the_tools(stack):
    script(stack, "prompt", "hi", 1)
    stack.run(collect(stack, chat("prompt"), rpc="Chat"))
    prompt = stack.tokenizer.decode(stack.engine.added["prompt"].prompt_token_ids, skip_special_tokens=False)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    assert stack.engine.added["prompt"].sampling_params.structured.WhichOneof("constraint") is None


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_is_the_array_constraint(stack, parallel):
    request_id = f"required-{parallel}"
    script(stack, request_id, '[{"name": "search", "parameters": {"q": "x"}}]', 1)
    request = chat(request_id, parallel_tool_calls=parallel,
                   tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED))
    responses = stack.run(collect(stack, request, rpc="Chat"))
    sent = json.loads(stack.engine.added[request_id].sampling_params.structured.json_schema)
    schemas = {t.name: json.loads(t.parameters_json) for t in TOOLS}
    assert sent == required_calls_schema(schemas, parallel=parallel, max_calls=16)  # the default --max-tool-calls
    assert sent["maxItems"] == (16 if parallel else 1)
    last = responses[-1].completions[-1]
    assert [(c.name, c.arguments_json) for c in last.tool_calls] == [("search", '{"q": "x"}')]
    assert last.finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS


def test_a_named_function_is_its_arguments_schema_and_streams_its_name_first(stack):
    script(stack, "named", '{"city": "Oslo"}', 1)
    request = chat("named", tool_choice=generation_pb2.ToolChoice(function_name="get_weather"))
    responses = stack.run(collect(stack, request, rpc="Chat"))
    assert json.loads(stack.engine.added["named"].sampling_params.structured.json_schema) == WEATHER
    deltas = [d for r in responses for c in r.completions for d in c.tool_call_deltas]
    assert deltas[0].name == "get_weather" and deltas[0].id
    assert "".join(d.arguments_json for d in deltas) == '{"city": "Oslo"}'


BAD = [
    ({"tools": [TOOLS[0], generation_pb2.Tool(name="broken", parameters_json='{"type": "object", "properties": 3}')]},
     "tools[1].parameters_json is not a valid JSON Schema"),
    ({"tools": [generation_pb2.Tool(name="f", parameters_json="{nope")]}, "tools[0].parameters_json is not JSON"),
    ({"tools": [generation_pb2.Tool(name="f", parameters_json='{"type": "string"}')]},
     "tools[0].parameters_json must describe an object"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].name 'get_weather' is given twice"),
    ({"tools": [generation_pb2.Tool(name="has space")]}, "tools[0].name 'has space' must be"),
    ({"tool_choice": generation_pb2.ToolChoice(function_name="launch")}, "tool_choice.function_name 'launch' is not"),
    ({"tools": [], "tool_choice": generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED)},
     "tool_choice is 'required' but tools is empty"),
    ({"tool_choice": generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED),
      "sampling": {"structured": common_pb2.StructuredOutput(json_object=True)}},
     "sampling_params.structured cannot be combined with tool_choice 'required'"),
    ({"tool_choice": generation_pb2.ToolChoice(mode=9)}, "tool_choice.mode 9 is not a ToolChoiceMode"),
]


@pytest.mark.parametrize("fields, message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_tools_are_refused_by_field_before_the_engine(stack, fields, message):
    request_id = f"bad-tools-{message[:24]}"
    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(collect(stack, chat(request_id, **fields), rpc="Chat"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message), info.value.details()
    assert request_id not in stack.engine.added


def test_tools_on_a_template_without_a_tools_branch_are_refused(make_stack, tokenizer):
    stack = make_stack()
    stack.llm.input_processor.chat_setup = ChatSetup(tokenizer.chat_template, "model", None)  # the GGUF's own
    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(collect(stack, chat("no-branch"), rpc="Chat"))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("tools: this model's chat template has no tools branch")
    assert "no-branch" not in stack.engine.added


def test_history_with_calls_and_results_renders_and_bad_arguments_are_refused(stack):
    call = generation_pb2.ToolCall(id="call_1", name="search", arguments_json='{"q": "rain"}')
    messages = [generation_pb2.ChatMessage(role="user", content="Rain?"),
                generation_pb2.ChatMessage(role="assistant", tool_calls=[call]),
                generation_pb2.ChatMessage(role="tool", content="none today", tool_call_id="call_1")]
    async def tokenize():  # the call is made on the stack's loop
        return await stack.stub.Tokenize(generation_pb2.TokenizeRequest(chat=generation_pb2.ChatRequest(
            messages=messages, tools=TOOLS)))
    tokens = stack.run(tokenize())
    prompt = stack.tokenizer.decode(list(tokens.token_ids), skip_special_tokens=False)
    assert '<tool_call>\n{"name": "search", "arguments": {"q": "rain"}}\n</tool_call>' in prompt
    assert "<tool_response>\nnone today\n</tool_response>" in prompt
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt  # Tokenize shows tools too
    messages[1].tool_calls[0].arguments_json = '"not an object"'
    with pytest.raises(grpc.aio.AioRpcError) as info:
        stack.run(collect(stack, generation_pb2.ChatRequest(request_id="bad-history", messages=messages), rpc="Chat"))
    assert info.value.details().startswith("messages[1].tool_calls[0].arguments_json must be a JSON object")
