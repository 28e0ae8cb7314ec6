"""`tandem chat` and `tandem generate` against the real frontend over a scripted fake engine (tests/frontend's
harness): the engine writes the model's tokens as each test scripts them, so a tool call that max_tokens cuts,
the turn after a tool result and the LoRA adapter a request names are the same on every run. The Node client
(clients/node/chat.js) meets the same cut call.

The CLI runs in a subprocess on the stack's event loop (which serves the frontend and the engine meanwhile),
fed one line at a time: each reply is awaited on the CLI's own output, the call ids it prints go into the next
lines."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import pytest

from clients.client import TandemClient
from tests.clients.conftest import REPO
from tests.clients.test_node_client import node, node_chat  # noqa: F401 - the node fixture
from tests.frontend.conftest import make_stack, tokenizer, wait_until  # noqa: F401 - the stack fixtures

TOOLS_FILE = REPO / "docs" / "examples" / "tools.json"
TOOLS = json.loads(TOOLS_FILE.read_text())
WEATHER_SCHEMA = TOOLS[0]["parameters"]
CUT_CALL = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'  # where max_tokens cuts
CALL_END = 'lo"}}\n</tool_call>'
REPLY_TIMEOUT_S = 60  # a bound on a reply that never comes, not a wait


class CliProcess:
    """`tandem ARGS` in a subprocess whose stdin is written a line at a time and whose output is read as it
    comes; use on the stack's loop."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.stderr_lines: list[str] = []

    @classmethod
    async def start(cls, *args: str) -> CliProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("TANDEM_API_TOKEN", None)
        pipe = asyncio.subprocess.PIPE
        return cls(await asyncio.create_subprocess_exec(sys.executable, "-m", "clients.cli", *args, stdin=pipe,
                                                        stdout=pipe, stderr=pipe, cwd=REPO, env=env))

    async def say(self, line: str) -> None:
        self.process.stdin.write(line.encode() + b"\n")
        await self.process.stdin.drain()

    async def stdout_line(self) -> str:
        line = await asyncio.wait_for(self.process.stdout.readline(), REPLY_TIMEOUT_S)
        assert line, f"tandem ended early: {await self.process.stderr.read()!r}"
        return line.decode().rstrip("\n")

    async def stderr_line_with(self, text: str) -> str:
        """The next stderr line that holds `text` (others, e.g. gRPC's own logs, are kept in stderr_lines)."""
        while True:
            line = await asyncio.wait_for(self.process.stderr.readline(), REPLY_TIMEOUT_S)
            assert line, f"tandem's stderr ended without {text!r}: {self.stderr_lines}"
            self.stderr_lines.append(line.decode().rstrip("\n"))
            if text in self.stderr_lines[-1]:
                return self.stderr_lines[-1]

    async def finish(self) -> tuple[int, str, str]:
        """Close stdin (EOF ends a chat) and wait for the exit: (exit code, stdout left, stderr left)."""
        if self.process.stdin.can_write_eof():
            self.process.stdin.write_eof()
        out, err = await asyncio.wait_for(self.process.communicate(), REPLY_TIMEOUT_S)
        return self.process.returncode, out.decode(), err.decode()

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


def run_cli(stack, scenario) -> None:
    """Run `scenario(start)` on the stack's loop; `start(*args)` starts `tandem ARGS`, killed if left running."""
    started: list[CliProcess] = []

    async def start(*args: str) -> CliProcess:
        started.append(await CliProcess.start(*args, "--address", f"127.0.0.1:{stack.frontend.port}"))
        return started[-1]

    async def run() -> None:
        try:
            await scenario(start)
        finally:
            for cli in started:
                cli.kill()
                await cli.process.wait()

    stack.run(run())


@pytest.fixture
def scripted(make_stack):  # noqa: F811 - the stack fixture
    """A stack whose engine writes `stack.replies` in the order requests come (text, or token ids)."""
    stack = make_stack()
    stack.replies = []

    def next_reply(request) -> list[int]:
        reply = stack.replies.pop(0)
        return answer(stack, reply) if isinstance(reply, str) else reply

    stack.engine.script = next_reply
    return stack


def tokens(stack, text: str) -> list[int]:
    return stack.tokenizer.encode(text, add_special_tokens=False)


def answer(stack, text: str) -> list[int]:
    """A reply that ends (EOS) after `text`."""
    return tokens(stack, text) + [stack.engine.eos_token_id]


def requests(stack) -> list:
    """The engine's requests in the order they came."""
    return list(stack.engine.added.values())


def prompt_of(stack, request) -> str:
    return stack.tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=False)


def test_a_cut_tool_call_is_shown_and_the_chat_goes_on(scripted):
    cut_at = len(tokens(scripted, CUT_CALL))
    scripted.replies += [tokens(scripted, CUT_CALL) + tokens(scripted, CALL_END), "It is sunny in Lima."]

    async def scenario(start) -> None:
        chat = await start("chat", "--tools", str(TOOLS_FILE), "--temperature", "0", "--max-tokens", str(cut_at))
        await chat.say("Weather in Oslo?")
        assert await chat.stdout_line() == "Let me check."
        cut = json.loads(await chat.stdout_line())["cut_tool_call"]
        assert cut["name"] == "get_weather" and cut["id"].startswith("call_")
        assert (cut["finish_reason"], cut["arguments_json"]) == ("length", '{"city": "Os')
        assert "finish reason length" in await chat.stderr_line_with(cut["id"])

        await chat.say(f"/tool {cut['id']} 12 C")  # a cut call is not in the history to answer
        line = await chat.stderr_line_with("tool call id")
        assert line == f"(tool call id {cut['id']!r} was cut by max_tokens and cannot be answered; known ids: none)"
        await chat.say("Weather in Lima?")
        assert await chat.stdout_line() == "It is sunny in Lima."
        code, out, err = await chat.finish()
        assert (code, out) == (0, ""), err

    run_cli(scripted, scenario)
    first, second = requests(scripted)  # the refused /tool sent nothing
    # the cut call stayed out of the history (the server refuses unfinished arguments), the text went in
    assert "<|im_start|>assistant\nLet me check.<|im_end|>\n<|im_start|>user\nWeather in Lima?" in prompt_of(
        scripted, second)


def test_the_python_client_reads_a_cut_call_without_raising(scripted):
    cut_at = len(tokens(scripted, CUT_CALL))
    scripted.replies.append(tokens(scripted, CUT_CALL) + tokens(scripted, CALL_END))

    def chat() -> list:
        with TandemClient(f"127.0.0.1:{scripted.frontend.port}", timeout=REPLY_TIMEOUT_S) as client:
            return list(client.chat([{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS, max_tokens=cut_at))

    chunks = scripted.run(asyncio.to_thread(chat))
    (call,) = chunks[-1].tool_calls
    assert chunks[-1].finish_reason == "length"
    assert (call.name, call.complete, call.arguments, call.arguments_json) == ("get_weather", False, None,
                                                                              '{"city": "Os')


def test_the_node_client_shows_a_cut_call_and_exits_normally(node, scripted):  # noqa: F811 - the node fixture
    """A cut call is the model's output (finish reason length), not an error: printed as tandem chat prints it,
    with a note on stderr, exit 0; JSON.parse of its arguments threw before."""
    cut_at = len(tokens(scripted, CUT_CALL))
    scripted.replies.append(tokens(scripted, CUT_CALL) + tokens(scripted, CALL_END))
    result = scripted.run(asyncio.to_thread(
        node_chat, node, "--address", f"127.0.0.1:{scripted.frontend.port}", "--tools", str(TOOLS_FILE),
        "--temperature", "0", "--max-tokens", str(cut_at), "Weather in Oslo?"))
    assert result.returncode == 0, result.stderr
    text, line = result.stdout.splitlines()
    cut = json.loads(line)["cut_tool_call"]
    assert text == "Let me check." and cut["name"] == "get_weather" and cut["id"].startswith("call_")
    assert (cut["finish_reason"], cut["arguments_json"]) == ("length", '{"city": "Os')
    assert f"(tool call {cut['id']} (get_weather) was cut, finish reason length" in result.stderr


def test_a_tool_result_for_an_unknown_id_is_refused_naming_the_known_ones(scripted):
    scripted.replies += ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
                         "12 C and rain in Oslo."]

    async def scenario(start) -> None:
        chat = await start("chat", "--tools", str(TOOLS_FILE), "--temperature", "0", "--max-tokens", "64")
        await chat.say("/tool call_early 12 C")  # before any call
        assert await chat.stderr_line_with("tool call id") == "(tool call id 'call_early' is unknown; known ids: none)"
        await chat.say("Weather in Oslo?")
        assert await chat.stdout_line() == ""
        call = json.loads(await chat.stdout_line())["tool_call"]
        assert (call["name"], call["arguments"]) == ("get_weather", {"city": "Oslo"})
        await chat.say("/tool call_typo 12 C")
        line = await chat.stderr_line_with("tool call id")
        assert line == f"(tool call id 'call_typo' is unknown; known ids: {call['id']})"
        await chat.say(f"/tool {call['id']} 12 C, rain")  # the session went on: the right id is answered
        assert await chat.stdout_line() == "12 C and rain in Oslo."
        code, _, err = await chat.finish()
        assert code == 0, err

    run_cli(scripted, scenario)
    assert len(requests(scripted)) == 2  # the refused results sent nothing
    assert "12 C, rain" in prompt_of(scripted, requests(scripted)[1])


def test_a_forced_tool_choice_forces_the_first_turn_only_and_the_model_answers_the_result(scripted):
    scripted.replies += ['{"city": "Oslo"}', "12 C and rain in Oslo.", '{"city": "Lima"}']

    async def scenario(start) -> None:
        chat = await start("chat", "--tools", str(TOOLS_FILE), "--tool-choice", "get_weather", "--temperature", "0",
                           "--max-tokens", "64")
        for city in ("Oslo", "Lima"):
            await chat.say(f"Weather in {city}?")
            assert await chat.stdout_line() == ""
            call = json.loads(await chat.stdout_line())["tool_call"]
            assert (call["name"], call["arguments"]) == ("get_weather", {"city": city})
            if city == "Oslo":
                await chat.say(f"/tool {call['id']} 12 C, rain")
                assert await chat.stdout_line() == "12 C and rain in Oslo."
        code, _, err = await chat.finish()
        assert code == 0, err

    run_cli(scripted, scenario)
    forced, after_result, next_message = (r.sampling_params.structured for r in requests(scripted))
    assert json.loads(forced.json_schema) == json.loads(next_message.json_schema) == WEATHER_SCHEMA
    assert after_result.WhichOneof("constraint") is None  # auto: the model may write text


def test_lora_names_the_adapter_on_generate_and_chat_requests(scripted):
    scripted.replies += ["SELECT 1;", "Hello.", "Hi."]

    async def scenario(start) -> None:
        # the frontend counts itself connected once it has asked for the Connect stream; an announcement before
        # the engine has it open reaches nobody
        await wait_until(lambda: scripted.engine.num_connections > 0)
        scripted.engine.announce(lora_names=["sql"])  # as an engine that loaded the adapter says
        await wait_until(lambda: "sql" in scripted.client.engines()[0].state.lora_names)
        generate = await start("generate", "Top customers:", "--lora", "sql", "--request-id", "lora-generate")
        code, out, err = await generate.finish()
        assert (code, out) == (0, "SELECT 1;\n"), err
        for flags, reply in ((["--lora", "sql"], "Hello."), ([], "Hi.")):
            chat = await start("chat", *flags)
            await chat.say("Hi")
            assert await chat.stdout_line() == reply
            code, _, err = await chat.finish()
            assert code == 0, err
        missing = await start("generate", "Top customers:", "--lora", "nope")
        code, out, err = await missing.finish()
        assert code == 1 and err.startswith("tandem: NOT_FOUND: no engine has the LoRA adapter 'nope' loaded"), err

    run_cli(scripted, scenario)
    assert scripted.engine.added["lora-generate"].lora_name == "sql"
    generated, with_adapter, base_model = requests(scripted)
    assert (with_adapter.lora_name, base_model.lora_name) == ("sql", "")
