"""Structured output from every client: the Python clients' keywords, the CLI's flags and the Node
client's flags, against the live stack (a tiny random model: constrained garbage that validates)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from clients.async_client import AsyncTandemClient
from clients.client import TandemClient
from clients.errors import TandemError
from tests.clients.conftest import REPO, run_async, run_cli
from tests.structured.schemas import CHOICES, PHONE_REGEX, SCHEMAS, check_json, check_regex

SHIPPED_SCHEMA = REPO / "docs" / "examples" / "person.schema.json"  # what docs/structured-output.md's examples pass


def finished_texts(chunks) -> dict[int, tuple[str, str]]:
    texts, reasons = {}, {}
    for chunk in chunks:
        for c in chunk.completions:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    return {i: (texts[i], reasons[i]) for i in texts}


def test_python_client_json_schema_keyword(live_stack):
    schema = SCHEMAS["order"]
    with TandemClient(live_stack.frontend_address, timeout=60) as client:
        results = finished_texts(client.generate("An order:", json_schema=schema, n=3, temperature=0.8, seed=4,
                                                 max_tokens=120))
        with pytest.raises(TandemError) as info:
            list(client.generate("x", regex="(", max_tokens=3))
    assert info.value.code.name == "INVALID_ARGUMENT" and "structured.regex" in info.value.message
    assert [reason for _, reason in results.values()].count("stop") >= 1
    for text, reason in results.values():
        if reason == "stop":
            check_json(text, schema)


def test_async_client_regex_and_chat_choice(live_stack):
    async def run():
        async with AsyncTandemClient(live_stack.frontend_address, timeout=60) as client:
            phone = [c async for c in client.generate("Call me at", regex=PHONE_REGEX, max_tokens=40, seed=1)]
            answer = [c async for c in client.chat([("user", "Mood?")], choice=list(CHOICES), temperature=0)]
            return finished_texts(phone)[0], finished_texts(answer)[0]

    (phone, phone_reason), (answer, answer_reason) = run_async(run())
    assert phone_reason == "stop" and answer_reason == "stop"
    check_regex(phone)
    assert answer in CHOICES


def test_cli_flags(live_stack, tmp_path):
    address = live_stack.frontend_address
    result = run_cli("generate", "Pick one:", "--choice", "left", "--choice", "right", "--temperature", "0",
                     "--address", address)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("left", "right")
    for schema_file in (tmp_path / "person.schema.json", SHIPPED_SCHEMA):  # the docs' example file too
        if schema_file != SHIPPED_SCHEMA:
            schema_file.write_text(json.dumps(SCHEMAS["person"]))
        schema = json.loads(schema_file.read_text())
        result = run_cli("generate", "A person:", "--json-schema", str(schema_file), "--temperature", "0.7",
                         "--seed", "3", "--max-tokens", "150", "--address", address)
        assert result.returncode == 0, result.stderr
        if "finish: stop" in result.stderr:  # "finish: length" may cut the structure short
            check_json(result.stdout.strip(), schema)
    result = run_cli("generate", "x", "--grammar", str(tmp_path / "missing.lark"), "--address", address)
    assert result.returncode == 1 and "--grammar: cannot read" in result.stderr


def test_node_client_flags(live_stack):
    node = shutil.which("node")
    if node is None or not (REPO / "clients" / "node" / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.skip("node, or clients/node's packages (make install runs npm ci), are not installed")
    result = subprocess.run([node, str(REPO / "clients" / "node" / "chat.js"), "--address", live_stack.frontend_address,
                             "--choice", "yes", "--choice", "no", "--temperature", "0", "Is the sky blue?"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() in ("yes", "no")
