"""Every `tandem` client command as a user runs it (a subprocess) against the live stack."""

from __future__ import annotations

import json
import re

import pytest

from clients.cli.main import main
from clients.client import TandemClient
from clients.local_stack import free_port
from tests.clients.conftest import run_cli
from tests.test_stack import MAX_MODEL_LEN

COMMANDS = ("serve", "generate", "chat", "tokenize", "info", "health", "admin", "bench", "plans")


@pytest.fixture(scope="module")
def address(live_stack):
    return live_stack.frontend_address


@pytest.fixture(scope="module")
def client(address):
    with TandemClient(address, timeout=60) as c:
        yield c


def greedy_text(chunks) -> str:
    return "".join(chunk.text for chunk in chunks)


def test_every_command_has_help_with_examples(capsys):
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        assert "examples:\n  tandem " + command in capsys.readouterr().out, command
    result = run_cli("--help")  # and the real entry point
    assert result.returncode == 0 and all(command in result.stdout for command in COMMANDS)


def test_chat_help_example_is_one_shell_line(capsys):
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    assert "  printf 'Hi!\\nWhat did I just say?\\n' | tandem chat --max-tokens 32" in capsys.readouterr().out


def test_help_shows_each_default_once(capsys):
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert "(default: None)" not in text and "(default: False)" not in text, command
        for option in re.split(r"\n(?=  -)|\n\n", text):  # one option's help (wrapped lines included) per piece
            assert option.count("default") <= 1, (command, option)


def test_generate_n_prints_each_completion_labelled(address):
    result = run_cli("generate", "Once upon a time", "--n", "3", "--temperature", "0.8", "--seed", "1",
                     "--max-tokens", "6", "--ignore-eos", "--address", address)
    assert result.returncode == 0, result.stderr
    labels = re.findall(r"^--- completion (\d) \(finish: (\w+)\) ---$", result.stdout, re.MULTILINE)
    assert sorted(labels) == [("0", "length"), ("1", "length"), ("2", "length")]
    assert "18 completion tokens" in result.stderr

    result = run_cli("generate", "Once upon a time", "--n", "2", "--temperature", "0", "--max-tokens", "5",
                     "--ignore-eos", "--json", "--address", address)
    assert result.returncode == 0, result.stderr
    messages = [json.loads(line) for line in result.stdout.splitlines()]
    for index in (0, 1):
        mine = [m for m in messages if m.get("index") == index]
        assert sum(len(m["token_ids"]) for m in mine) == 5 and mine[-1]["finish_reason"] == "length"


def test_generate_streams_the_same_text_as_the_client(address, client):
    expected = greedy_text(client.generate("The weather today", temperature=0, max_tokens=12, ignore_eos=True))
    result = run_cli("generate", "The weather today", "--temperature", "0", "--max-tokens", "12", "--ignore-eos",
                     "--address", address)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected + "\n"
    assert "12 completion tokens" in result.stderr and "finish: length" in result.stderr


def test_generate_json_from_token_ids(address, client):
    ids = client.tokenize("Good morning").token_ids
    result = run_cli("generate", "--token-ids", ",".join(map(str, ids)), "--temperature", "0", "--max-tokens", "5",
                     "--ignore-eos", "--json", "--address", address)
    assert result.returncode == 0, result.stderr
    messages = [json.loads(line) for line in result.stdout.splitlines()]
    assert sum(len(m["token_ids"]) for m in messages) == 5
    assert messages[-1]["finish_reason"] == "length" and messages[-1]["usage"]["prompt_tokens"] == len(ids)


def test_max_tokens_the_context_has_no_room_for_fails_unless_clamped(address):
    prompt = ",".join(["42"] * (MAX_MODEL_LEN - 3))  # room for 3 generated tokens
    common = ("generate", "--token-ids", prompt, "--temperature", "0", "--ignore-eos", "--json", "--address", address)
    refused = run_cli(*common, "--max-tokens", "50")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith("tandem: INVALID_ARGUMENT: sampling_params.max_tokens is too large")
    assert f"maximum context length is {MAX_MODEL_LEN} tokens and the prompt has {MAX_MODEL_LEN - 3}" in refused.stderr
    for cut in (run_cli(*common, "--max-tokens", "50", "--clamp-max-tokens"), run_cli(*common)):  # the default: cut
        assert cut.returncode == 0, cut.stderr
        messages = [json.loads(line) for line in cut.stdout.splitlines()]
        assert sum(len(m["token_ids"]) for m in messages) == 3 and messages[-1]["finish_reason"] == "length"


def test_chat_from_piped_stdin_keeps_the_history(address, client):
    sampling = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}
    result = run_cli("chat", "--temperature", "0", "--max-tokens", "10", "--ignore-eos", "--system", "Be nice.",
                     "--address", address, stdin="Hello there\n\n/reset\nHow are you?\nAnd then?\n")
    assert result.returncode == 0, result.stderr
    first, second, third = result.stdout.split("\n")[:3]
    system = {"role": "system", "content": "Be nice."}
    assert first == greedy_text(client.chat([system, {"role": "user", "content": "Hello there"}], **sampling))
    history = [system, {"role": "user", "content": "How are you?"}]  # /reset dropped the first turn
    assert second == greedy_text(client.chat(history, **sampling))
    history += [{"role": "assistant", "content": second}, {"role": "user", "content": "And then?"}]
    assert third == greedy_text(client.chat(history, **sampling))
    assert "history cleared" in result.stderr


def test_tokenize_and_decode(address, client):
    expected = client.tokenize("Hello world")
    result = run_cli("tokenize", "Hello world", "--address", address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == " ".join(map(str, expected.token_ids))
    decoded = run_cli("tokenize", "--decode", *map(str, expected.token_ids), "--address", address)
    assert decoded.stdout == "Hello world\n"
    chat = json.loads(run_cli("tokenize", "Hi", "--chat", "--json", "--address", address).stdout)
    assert chat["token_ids"] == list(client.tokenize(messages=[("user", "Hi")]).token_ids)


def test_info_and_health(address, live_stack):
    result = run_cli("info", "--json", "--address", address)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["model"]["max_model_len"] == MAX_MODEL_LEN  # the proto's names, snake_case as every --json
    assert "has_chat_template" in info["model"] and "max_waiting_requests" in info["server"]
    assert info["server"]["engines"][0]["address"] == live_stack.engine_address
    text = run_cli("info", "--address", address).stdout
    assert f"max_model_len  {MAX_MODEL_LEN}" in text and "connected, admitting" in text
    assert "state          serving" in text  # tests/clients/test_admin.py covers draining, paused and asleep
    health = run_cli("health", "--address", address)
    assert (health.returncode, health.stdout) == (0, "SERVING\n")
    service = run_cli("health", "--service", "tandem.v1.GenerationService", "--address", address)  # as in --help
    assert (service.returncode, service.stdout) == (0, "SERVING\n"), service.stderr


def test_a_bad_request_prints_the_status_and_message_not_a_traceback(address):
    result = run_cli("generate", "hi", "--top-p", "0", "--address", address)
    assert result.returncode == 1
    assert result.stderr.startswith("tandem: INVALID_ARGUMENT: sampling_params.top_p")
    assert "Traceback" not in result.stderr
    local = run_cli("tokenize", "--decode", "1", "x", "--address", address)
    assert local.returncode == 1 and local.stderr.startswith("tandem: INVALID_ARGUMENT: --decode expects integers")


def test_an_unreachable_server_is_unavailable():
    for command in (["health"], ["generate", "hi"], ["info"]):
        result = run_cli(*command, "--address", f"127.0.0.1:{free_port()}", "--retries", "0", "--timeout", "10")
        assert result.returncode == 1, command
        assert result.stderr.startswith("tandem: UNAVAILABLE: ") and "Traceback" not in result.stderr
