"""The OpenAI HTTP API of a real smg in front of a real Tandem stack (tiny random model): what a user of the
gateway sees, from /v1/models to a tool call, a cut stream and a frontend that comes back."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from clients.gateway import GatewayError, post_json, stream_sse
from tests.gateway.conftest import chat
from tests.test_stack import engine_stats, wait_for_all_blocks_free
from tests.waits import STATE_TIMEOUT_S

GREEDY = {"temperature": 0, "ignore_eos": True}


def test_models_lists_the_frontends_model(gateway_stack):
    from clients.gateway import get_json

    models = get_json(gateway_stack.url("/v1/models"))["data"]
    assert [m["id"] for m in models] == [gateway_stack.model]


def test_chat_streamed_and_not_give_the_same_greedy_answer(gateway_stack):
    whole = chat(gateway_stack, "Name three colours.", max_tokens=12, **GREEDY)
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 12
    events = list(stream_sse(gateway_stack.url("/v1/chat/completions"), {
        "model": gateway_stack.model, "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 12, "stream_options": {"include_usage": True}, **GREEDY}))
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == choice["message"]["content"] and len(text) > 0
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["length"]
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert events[-1]["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]


def test_completions_with_n_2(gateway_stack):
    answer = post_json(gateway_stack.url("/v1/completions"), {
        "model": gateway_stack.model, "prompt": "Once upon a time", "max_tokens": 6, "n": 2, "seed": 7,
        "temperature": 1.0, "ignore_eos": True})
    assert sorted(c["index"] for c in answer["choices"]) == [0, 1]
    assert all(c["finish_reason"] == "length" and c["text"] for c in answer["choices"])
    assert answer["usage"]["completion_tokens"] == 12


def test_chat_logprobs(gateway_stack):
    answer = chat(gateway_stack, "Hi", max_tokens=4, logprobs=True, top_logprobs=3, **GREEDY)
    entries = answer["choices"][0]["logprobs"]["content"]
    assert len(entries) == 4
    for entry in entries:
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] <= 0
        best = entry["top_logprobs"][0]
        assert best["token"] == entry["token"] and best["logprob"] == pytest.approx(entry["logprob"])  # greedy
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True)


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


def test_response_format_json_schema_validates(gateway_stack):
    answer = chat(gateway_stack, "Describe a person as JSON.", max_tokens=80, temperature=0,
                  response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_a_stop_string_ends_the_answer_early(gateway_stack):
    """smg neither aborts nor cancels on its own stop match: the worker must stop, or the call would run to
    max_tokens; here it ends within a token of the stop string."""
    full = chat(gateway_stack, "Count with me.", max_tokens=40, **GREEDY)["choices"][0]["message"]["content"]
    words = full.split(" ")
    stop = " " + words[len(words) // 2]
    assert stop.strip() and full.index(stop) > 0
    for stream in (False, True):
        body = {"model": gateway_stack.model, "messages": [{"role": "user", "content": "Count with me."}],
                "max_tokens": 40, "stop": [stop], **GREEDY}
        if stream:
            events = list(stream_sse(gateway_stack.url("/v1/chat/completions"),
                                     {**body, "stream_options": {"include_usage": True}}))
            text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
            finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
            usage = events[-1]["usage"]
        else:
            answer = post_json(gateway_stack.url("/v1/chat/completions"), body)
            text, usage = answer["choices"][0]["message"]["content"], answer["usage"]
            finish = [answer["choices"][0]["finish_reason"]]
        assert text == full[:full.index(stop)] and finish == ["stop"]
        assert usage["completion_tokens"] < 40


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def test_a_hermes_tool_call_is_parsed_by_smgs_parser(gateway_stack):
    """tool_choice auto: the model's own <tool_call> text, read by smg's qwen parser (the Hermes format; smg
    1.13 has no parser named hermes). The tiny model is steered into the call with smg's `regex` extension."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    answer = chat(gateway_stack, "What is the weather in Paris?", max_tokens=60, temperature=0,
                  tools=[WEATHER_TOOL], tool_choice="auto", regex=call.replace("{", r"\{").replace("}", r"\}"))
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [tool_call] = choice["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris"}


def test_a_named_tool_choice_gets_arguments_that_validate(gateway_stack):
    """A named tool_choice: smg sends a json_schema constraint (applied by the engine) and parses the JSON."""
    answer = chat(gateway_stack, "Weather?", max_tokens=60, temperature=0, tools=[WEATHER_TOOL],
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [tool_call] = answer["choices"][0]["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(tool_call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_bad_input_is_a_clear_http_error(gateway_stack):
    with pytest.raises(GatewayError) as error:
        chat(gateway_stack, "Hi", max_tokens=10, top_p=1.5)
    assert 400 <= error.value.status < 500


def test_a_client_that_disconnects_mid_stream_frees_the_engine(gateway_stack):
    """smg answers a dropped streaming client with Abort (it does not cancel the gRPC stream): the request
    ends in the engine and every KV block comes back."""
    body = {"model": gateway_stack.model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 1500, **GREEDY}
    for _ in range(3):
        events = stream_sse(gateway_stack.url("/v1/chat/completions"), body)
        for _, _event in zip(range(5), events):
            pass
        assert engine_stats(gateway_stack.engine_address).num_running_reqs == 1
        events.close()  # the HTTP connection closes mid-answer
        wait_for_all_blocks_free(gateway_stack.engine_address, timeout=20)


def test_smg_recovers_when_the_frontend_is_killed_and_restarted(gateway_stack):
    assert chat(gateway_stack, "Hi", max_tokens=3, **GREEDY)["choices"][0]["finish_reason"] == "length"
    gateway_stack.kill_frontend()
    with pytest.raises(GatewayError):
        chat(gateway_stack, "Hi", max_tokens=3, **GREEDY)
    gateway_stack.start_frontend()
    deadline = time.monotonic() + STATE_TIMEOUT_S
    while True:
        try:
            answer = chat(gateway_stack, "Hi", max_tokens=3, **GREEDY)
            break
        except (GatewayError, OSError):
            assert time.monotonic() < deadline, "smg did not route to the restarted frontend"
            time.sleep(0.5)
    assert answer["choices"][0]["finish_reason"] == "length"
