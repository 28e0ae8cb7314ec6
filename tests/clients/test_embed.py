"""Embed over the public API (Python clients and `tandem embed`) against a live two-process stack.

The reference is transformers' final hidden states (after the last norm) of the same tiny
checkpoint, pooled the same way; generation running at the same time must not change."""

from __future__ import annotations

import json
import threading

import grpc
import pytest
import torch

from clients.async_client import AsyncTandemClient
from clients.client import TandemClient
from clients.errors import TandemError
from tests.clients.conftest import run_async, run_cli
from tests.test_stack import MAX_MODEL_LEN

GREEDY = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(live_stack):
    with TandemClient(live_stack.frontend_address, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf_model(live_stack):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(live_stack.model_dir, dtype=torch.float32).eval()


def pooled(hf_model, ids, pooling: str, normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([list(ids)])).last_hidden_state[0]
    vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


@pytest.mark.parametrize("pooling, normalize", [("last", True), ("mean", False), ("cls", True), ("mean", True)])
def test_embeddings_equal_transformers_pooled_the_same_way(client, hf_model, pooling, normalize):
    texts = ["The capital of France is", "Embeddings come from the final hidden states of the model."]
    ids = [client.tokenize(t).token_ids for t in texts]
    result = client.embed([texts[0], list(ids[1]), texts[1]], pooling=pooling, normalize=normalize)
    assert result.num_prompt_tokens == (len(ids[0]), len(ids[1]), len(ids[1]))
    assert result.usage.prompt_tokens == sum(result.num_prompt_tokens) and result.usage.completion_tokens == 0
    for vector, tokens in zip(result.embeddings, [ids[0], ids[1], ids[1]]):
        expected = pooled(hf_model, tokens, pooling, normalize)
        torch.testing.assert_close(torch.tensor(vector), expected, atol=1e-4, rtol=0)


def test_embeddings_alongside_generation_change_no_token(client):
    alone = [t for c in client.generate("Once upon a time", **GREEDY) for t in c.token_ids]
    beside: list[int] = []

    def generate():
        beside.extend(t for c in client.generate("Once upon a time", **GREEDY) for t in c.token_ids)

    thread = threading.Thread(target=generate)
    thread.start()
    results = [client.embed(["a cat sat on the mat " * k for k in range(1, 6)], pooling="mean") for _ in range(4)]
    thread.join(60)
    assert beside == alone
    for result in results[1:]:  # batched differently each time (other kernels per batch size): close, not bitwise
        torch.testing.assert_close(torch.tensor(result.embeddings), torch.tensor(results[0].embeddings),
                                   atol=1e-5, rtol=0)


def test_async_client_and_cli_agree_with_the_sync_client(client, live_stack):
    sync = client.embed("Hello world", pooling="last")

    async def main():
        async with AsyncTandemClient(live_stack.frontend_address, timeout=60) as async_client:
            return await async_client.embed("Hello world", pooling="last")

    torch.testing.assert_close(torch.tensor(run_async(main()).embeddings), torch.tensor(sync.embeddings),
                               atol=1e-5, rtol=0)
    done = run_cli("embed", "Hello world", "--address", live_stack.frontend_address)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert len(printed["embeddings"]) == 1 and printed["usage"]["prompt_tokens"] == sync.usage.prompt_tokens
    torch.testing.assert_close(torch.tensor(printed["embeddings"][0]), torch.tensor(sync.embeddings[0]),
                               atol=1e-5, rtol=0)
    assert abs(torch.tensor(sync.embeddings[0]).norm().item() - 1.0) < 1e-5


def test_bad_inputs_are_invalid_argument(client):
    with pytest.raises(TandemError) as empty:
        client.embed([])
    assert empty.value.code == grpc.StatusCode.INVALID_ARGUMENT and "inputs is empty" in empty.value.message
    with pytest.raises(TandemError) as too_long:
        client.embed([[5] * MAX_MODEL_LEN])
    assert too_long.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"input has {MAX_MODEL_LEN} tokens" in too_long.value.message
    assert f"an embedding input may have at most {MAX_MODEL_LEN - 1} tokens" in too_long.value.message
    assert "generated" not in too_long.value.message  # embeddings generate nothing
    with pytest.raises(ValueError, match="pooling must be one of last, mean, cls"):
        client.embed("x", pooling="max")
