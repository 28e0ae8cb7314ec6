"""smg in front of `tandem serve`'s stack on the embedded SmolLM2 (fp32): the answers a user gets over HTTP."""

from __future__ import annotations

import json

import jsonschema
import pytest

from clients.gateway import Gateway, post_json
from clients.local_stack import free_port
from engine_core.loader import default_model_path
from tests.engine_core.test_loader import CHAT_PROMPT
from tests.gateway.test_smg_http import PERSON, WEATHER_TOOL
from tests.test_stack import Services

pytestmark = pytest.mark.slow  # loads the real SmolLM2 (make test-slow)

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smollm2_gateway(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2-gateway")
    services = Services(["--model", str(default_model_path()), "--dtype", "float32", "--max-model-len", "2048",
                         "--log-level", "WARNING"], ["--log-level", "WARNING"])
    # the frontend renders SmolLM2 with its shipped tools template (hermes-style calls: smg's qwen parser)
    gateway = Gateway([services.frontend_address], port=free_port(), log_file=root / "smg.log",
                      extra_args=["--tool-call-parser", "qwen"])
    try:
        gateway.start()
        gateway.model = gateway.wait_for_model()
        yield gateway
    finally:
        gateway.stop()
        services.stop()


def ask(gateway: Gateway, content: str, **options) -> dict:
    return post_json(gateway.url + "/v1/chat/completions",
                     {"model": gateway.model, "messages": [{"role": "user", "content": content}], **options})


def test_the_capital_of_france_is_paris(smollm2_gateway):
    answer = ask(smollm2_gateway, QUESTION, temperature=0, max_tokens=32)
    choice = answer["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    assert choice["finish_reason"] == "stop"  # <|im_end|>
    # smg rendered the frontend's own template (from GetTokenizer): the prompt transformers makes
    assert answer["usage"]["prompt_tokens"] == len(CHAT_PROMPT)


def test_a_json_schema_answer_validates(smollm2_gateway):
    answer = ask(smollm2_gateway, "Invent a person: name and age, as JSON.", temperature=0, max_tokens=80,
                 response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(answer["choices"][0]["message"]["content"]), PERSON)


def test_a_stop_string_ends_the_answer(smollm2_gateway):
    full = ask(smollm2_gateway, QUESTION, temperature=0, max_tokens=32)["choices"][0]["message"]["content"]
    answer = ask(smollm2_gateway, QUESTION, temperature=0, max_tokens=32, stop=["Paris"])
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == full[:full.index("Paris")]


def test_a_named_tool_call(smollm2_gateway):
    """The template smg renders tools with is the frontend's (SmolLM2's shipped tools template, from GetTokenizer).
    A named function: smg constrains the answer to the function's parameters schema (tool_choice "required"
    gets smg's looser array schema, under which SmolLM2-135M repeats calls to max_tokens)."""
    answer = ask(smollm2_gateway, "What is the weather in Paris?", temperature=0, max_tokens=60,
                 tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert answer["choices"][0]["message"].get("tool_calls"), json.dumps(answer)
    [call] = answer["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, WEATHER_TOOL["function"]["parameters"])
