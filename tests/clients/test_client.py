"""TandemClient and AsyncTandemClient against a live stack on a tiny model."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from clients.async_client import AsyncTandemClient
from clients.client import TandemClient
from clients.errors import TandemError
from clients.local_stack import free_port
from tests.clients.conftest import run_async
from tests.test_stack import MAX_MODEL_LEN, VOCAB
from tests.waits import STATE_TIMEOUT_S

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(live_stack):
    with TandemClient(live_stack.frontend_address, timeout=60) as c:
        yield c


def collect(chunks) -> tuple[str, list[int], list]:
    chunks = list(chunks)
    return "".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], chunks


# ---- sync -----------------------------------------------------------------------------------------
def test_generate_streams_typed_chunks_with_usage_and_finish_reason(client):
    text, ids, chunks = collect(client.generate("The capital of France is", **GREEDY))
    assert len(ids) == 8 and len(chunks) >= 2  # streamed, not one final message
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == len(client.tokenize("The capital of France is").token_ids)
    assert text == client.detokenize(ids)


def test_text_and_token_id_prompts_give_the_same_greedy_tokens(client):
    prompt_ids = client.tokenize("Once upon a time").token_ids
    _, from_text, _ = collect(client.generate("Once upon a time", **GREEDY))
    _, from_ids, _ = collect(client.generate(prompt_ids, **GREEDY))
    assert from_text == from_ids


def test_chat_equals_generate_on_the_rendered_template(client):
    messages = [{"role": "system", "content": "Be brief."}, ("user", "Name a colour.")]
    rendered = client.tokenize(messages=messages, add_generation_prompt=True).token_ids
    _, chat_ids, _ = collect(client.chat(messages, **GREEDY))
    _, generate_ids, _ = collect(client.generate(list(rendered), **GREEDY))
    assert chat_ids == generate_ids


def test_tokenize_detokenize_model_and_server_info_health(client, live_stack):
    tokens = client.tokenize("Hello world")
    assert len(tokens.tokens) == len(tokens.token_ids) and tokens.max_model_len == MAX_MODEL_LEN
    assert client.detokenize(tokens.token_ids) == "Hello world"
    info = client.model_info()
    assert (info.max_model_len, info.vocab_size, info.has_chat_template) == (MAX_MODEL_LEN, VOCAB, True)
    server = client.server_info()
    assert [(e.address, e.connected) for e in server.engines] == [(live_stack.engine_address, True)]
    assert client.health() == "SERVING"


def test_stopping_early_aborts_the_request_on_the_server(client):
    stream = client.generate("Count with me:", temperature=0, max_tokens=200, ignore_eos=True)
    next(stream)
    assert client.pause("keep").ok  # the engine holds it: it cannot finish before the close
    try:
        assert client.server_info().num_in_flight == 1
        stream.close()
    finally:
        assert client.resume().ok
    deadline = time.monotonic() + STATE_TIMEOUT_S
    while client.server_info().num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.server_info().num_in_flight == 0


def test_unknown_keywords_and_bad_values_fail_before_any_call(client):
    with pytest.raises(TypeError, match="did you mean 'temperature'"):
        client.generate("x", temprature=0)
    with pytest.raises(TypeError, match="unknown keyword argument 'colour'"):
        client.chat([("user", "hi")], colour="blue")
    with pytest.raises(TypeError, match="bad sampling parameter value"):
        client.generate("x", max_tokens="many")
    with pytest.raises(ValueError, match="output_kind"):
        client.generate("x", output_kind="sometimes")
    with pytest.raises(ValueError, match="messages\\[0\\]"):
        client.chat([{"role": "user", "text": "hi"}])
    with pytest.raises(TypeError, match="prompt must be"):
        client.generate(3.5)


def test_server_errors_carry_the_status_code_and_message(client):
    with pytest.raises(TandemError) as excinfo:
        list(client.generate("x", top_p=0))
    assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in excinfo.value.message
    with pytest.raises(TandemError) as excinfo:
        client.detokenize([VOCAB + 5])
    assert excinfo.value.code == grpc.StatusCode.INVALID_ARGUMENT and str(VOCAB + 5) in str(excinfo.value)
    stream = client.generate("x", temperature=0, max_tokens=MAX_MODEL_LEN - 10, ignore_eos=True, timeout=3.0)
    next(stream)
    assert client.pause("keep").ok  # the engine holds it mid-stream: the deadline passes on any CPU
    try:
        with pytest.raises(TandemError) as excinfo:
            list(stream)
    finally:
        assert client.resume().ok
    assert excinfo.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_unreachable_server_is_unavailable():
    with TandemClient(f"127.0.0.1:{free_port()}", timeout=10) as c:
        with pytest.raises(TandemError) as excinfo:
            c.tokenize("hi")
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE


# ---- async ----------------------------------------------------------------------------------------
def test_async_client_matches_the_sync_client(client, live_stack):
    prompts = ["The sky is", "Water boils at", "My favourite food is", "In 1969"]
    expected = [collect(client.generate(p, **GREEDY))[1] for p in prompts]
    messages = [{"role": "user", "content": "Say hi."}]
    expected_chat = collect(client.chat(messages, **GREEDY))[0]

    async def run():
        async with AsyncTandemClient(live_stack.frontend_address, timeout=60) as ac:
            async def ids(prompt):
                return [t async for chunk in ac.generate(prompt, **GREEDY) for t in chunk.token_ids]

            concurrent = await asyncio.gather(*(ids(p) for p in prompts))
            chat = "".join([chunk.text async for chunk in ac.chat(messages, **GREEDY)])
            tokens = await ac.tokenize("Hello world")
            text = await ac.detokenize(tokens.token_ids)
            info, server, health = await ac.model_info(), await ac.server_info(), await ac.health()
            with pytest.raises(TandemError) as excinfo:
                [c async for c in ac.generate("x", min_p=2)]
            return concurrent, chat, text, info.max_model_len, len(server.engines), health, excinfo.value.code

    concurrent, chat, text, max_len, engines, health, code = run_async(run())
    assert concurrent == expected and chat == expected_chat and text == "Hello world"
    assert (max_len, engines, health, code) == (MAX_MODEL_LEN, 1, "SERVING", grpc.StatusCode.INVALID_ARGUMENT)
