"""Tool calling from every client against the live stack's tiny random model, through a second frontend
started with --chat-template (a compact tools template: the stack's context is 256 tokens): the
constraint of tool_choice makes even random weights call the tool with arguments its schema accepts;
the Python client, `tandem chat --tools` and the Node client read the calls."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from clients.client import TandemClient
from clients.tools import ToolCall
from engine_core.loader import default_model_path
from tests.clients.conftest import REPO, run_cli
from tests.clients.test_node_client import node, node_chat  # noqa: F401 - the node fixture
from tests.test_stack import Services, free_port, wait_until_serving
from tests.waits import STARTUP_TIMEOUT_S

TOOLS_FILE = REPO / "docs" / "examples" / "tools.json"
TOOLS = json.loads(TOOLS_FILE.read_text())
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
SAMPLING = {"temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def tools_frontend(live_stack):
    """A frontend on the live stack's engine with a compact tools template (--chat-template)."""
    port = free_port()
    process = Services._spawn("services.frontend", "--engine", live_stack.engine_address, "--port", str(port),
                              "--host", "127.0.0.1", "--tokenizer", str(default_model_path()), "--log-level",
                              "WARNING", "--chat-template", str(Path(__file__).parent / "compact_tools.jinja"))
    try:
        wait_until_serving(f"127.0.0.1:{port}", STARTUP_TIMEOUT_S, process)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(15)


def test_python_client_streams_a_forced_call_and_reads_it_whole(tools_frontend):
    with TandemClient(tools_frontend, timeout=60) as client:
        chunks = list(client.chat([{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
                                  tool_choice={"name": "get_weather"}, **SAMPLING))
    (call,) = chunks[-1].tool_calls
    assert chunks[-1].finish_reason == "tool_calls" and call.name == "get_weather"
    jsonschema.validate(call.arguments, SCHEMAS["get_weather"])
    deltas = [d for c in chunks for completion in c.completions for d in completion.tool_call_deltas]
    assert deltas[0].name == "get_weather" and deltas[0].id == call.id
    assert "".join(d.arguments_json for d in deltas) == call.arguments_json


def test_required_with_one_call_and_the_history_goes_back_in(tools_frontend):
    with TandemClient(tools_frontend, timeout=60) as client:
        messages = [{"role": "user", "content": "Weather in Paris?"}]
        # get_weather's arguments are bounded (enums, 1..7): random weights finish them within max_tokens
        chunks = list(client.chat(messages, tools=TOOLS[:1], tool_choice="required", parallel_tool_calls=False,
                                  n=2, seed=3, temperature=1.0, max_tokens=48))
        for index in range(2):
            last = [c for chunk in chunks for c in chunk.completions if c.index == index][-1]
            assert last.finish_reason == "tool_calls" and len(last.tool_calls) == 1
            jsonschema.validate(last.tool_calls[0].arguments, SCHEMAS[last.tool_calls[0].name])
        call = chunks[-1].tool_calls[0]
        follow_up = [*messages, {"role": "assistant", "content": "", "tool_calls": [call]},
                     {"role": "tool", "content": "52.3", "tool_call_id": call.id}]
        answer = list(client.chat(follow_up, tools=TOOLS, **SAMPLING))
    assert answer[-1].finish_reason in ("stop", "length", "tool_calls")


def test_chat_cli_prints_the_calls_as_json_lines(tools_frontend):
    result = run_cli("chat", "--address", tools_frontend, "--tools", str(TOOLS_FILE),
                     "--tool-choice", "get_weather", "--temperature", "0", "--max-tokens", "48",
                     stdin="Weather in Lima?\n")
    assert result.returncode == 0, result.stderr
    calls = [json.loads(line)["tool_call"] for line in result.stdout.splitlines() if line.startswith('{"tool_call"')]
    assert [c["name"] for c in calls] == ["get_weather"]
    jsonschema.validate(calls[0]["arguments"], SCHEMAS["get_weather"])


@pytest.mark.parametrize("flags, message", [
    (["--tool-choice", "required"], "--tool-choice needs --tools"),
    (["--tools", str(REPO / "README.md")], "is not JSON"),
])
def test_chat_cli_refuses_bad_tool_flags_before_any_call(tools_frontend, flags, message):
    result = run_cli("chat", "--address", tools_frontend, *flags, stdin="hi\n")
    assert result.returncode != 0 and message in result.stderr


def test_node_client_prints_the_same_call(node, tools_frontend):  # noqa: F811 - the node fixture
    result = node_chat(node, "--address", tools_frontend, "--tools", str(TOOLS_FILE),
                       "--tool-choice", "get_weather", "--temperature", "0", "--max-tokens", "48", "Weather in Lima?")
    assert result.returncode == 0, result.stderr
    node_calls = [json.loads(line)["tool_call"] for line in result.stdout.splitlines() if line.startswith("{")]
    with TandemClient(tools_frontend, timeout=60) as client:
        chunks = list(client.chat([{"role": "user", "content": "Weather in Lima?"}], tools=TOOLS,
                                  tool_choice={"name": "get_weather"}, **SAMPLING))
    assert [(c["name"], c["arguments"]) for c in node_calls] == [(c.name, c.arguments) for c in chunks[-1].tool_calls]


@pytest.mark.parametrize("arguments_json", ['{"city": "Os', "", '{"city": "Oslo"', '"Oslo"', "[1]"])
def test_a_call_whose_arguments_are_not_a_whole_object_reads_as_cut_without_raising(arguments_json):
    call = ToolCall("call_1", 0, "get_weather", arguments_json)  # as max_tokens leaves it
    assert (call.complete, call.arguments, call.arguments_json) == (False, None, arguments_json)


def test_a_whole_call_reads_as_complete():
    call = ToolCall("call_1", 0, "get_weather", '{"city": "Oslo", "days": 2}')
    assert (call.complete, call.arguments) == (True, {"city": "Oslo", "days": 2})


def test_serve_passes_the_template_and_parser_flags_to_the_frontend(monkeypatch, tmp_path):
    from clients.cli import main as cli
    from clients.cli import serve_command

    started = {}

    class Recorder:
        def __init__(self, **kwargs):
            started.update(kwargs)

        def start(self):
            raise KeyboardInterrupt  # stop before anything runs

        def stop(self, *args):
            pass

    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    monkeypatch.setattr(serve_command, "LocalStack", Recorder)
    monkeypatch.setattr(serve_command.signal, "signal", lambda *args: None)  # serve's SIGTERM handler stays out
    try:
        cli.main(["serve", "--chat-template", str(template), "--tool-parser", "pythonic",
                  "--port", str(free_port()), "--engine-port", str(free_port())])  # ports that are free here
    except (KeyboardInterrupt, SystemExit):
        pass
    assert started["frontend_args"] == ["--chat-template", str(template), "--tool-parser", "pythonic"]
