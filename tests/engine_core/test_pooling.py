"""Pooling (embedding) requests in the engine: prefill only, in the same batches as generation.

The reference is transformers' final hidden states (after the last norm) of the same tiny
checkpoint, pooled the same way; prompts are longer than the token budget, so they are
prefilled in chunks, and some share a cached prefix with a generation request."""

from __future__ import annotations

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.engine_core import EngineCore
from engine_core.protocol import EngineCoreRequest, FinishReason, PoolingParams, PoolingType, SamplingParams
from tests.engine_core.tiny_models import write_tiny_model

VOCAB = 256
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
POOLED = SamplingParams(max_tokens=1)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("pool"), model_type="qwen3", head_dim=16, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def hf_model(folder):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def engine(folder, backend="torch") -> EngineCore:
    return EngineCore(EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32"),
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
        device=DeviceConfig(device="cpu", attention_backend=backend),
    ))


def run(core: EngineCore, requests: list[EngineCoreRequest], stats: list | None = None) -> dict:
    """request id -> (generated tokens, embedding or None); `stats` collects each step's scheduler stats."""
    for request in requests:
        core.add_request(request)
    results = {r.request_id: ([], None) for r in requests}
    while core.has_unfinished_requests():
        outputs = core.step()
        if stats is not None:
            stats.append(outputs.scheduler_stats)
        for out in outputs.outputs:
            tokens, embedding = results[out.request_id]
            tokens.extend(out.new_token_ids)
            if out.embedding is not None:
                assert out.finish_reason == FinishReason.STOP and not out.new_token_ids
                embedding = out.embedding
            results[out.request_id] = (tokens, embedding)
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1  # nothing kept
    return results


def reference(hf_model, prompt: list[int], pooling: PoolingParams) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]  # [L, hidden], after the norm
    vector = {PoolingType.LAST: hidden[-1], PoolingType.MEAN: hidden.mean(0), PoolingType.CLS: hidden[0]}
    vector = vector[pooling.pooling_type]
    return torch.nn.functional.normalize(vector, dim=-1) if pooling.normalize else vector


def prompts(lengths, shared=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(4, VOCAB, (shared,), generator=g).tolist()
    return [prefix + torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_embeddings_match_transformers_alongside_generation(folder, hf_model, backend):
    generate = prompts([5, 30], shared=12, seed=1)
    alone = run(engine(folder, backend), [EngineCoreRequest(f"g{i}", p, GREEDY) for i, p in enumerate(generate)])
    kinds = [PoolingParams(kind, normalize) for kind in PoolingType for normalize in (True, False)]
    embed = prompts([3, 19, 37, 1, 25, 8], shared=12, seed=1)  # shares the generation requests' prefix
    mixed = [EngineCoreRequest(f"g{i}", p, GREEDY) for i, p in enumerate(generate)]
    mixed += [EngineCoreRequest(f"e{i}", p, POOLED, pooling=kinds[i]) for i, p in enumerate(embed)]
    results = run(engine(folder, backend), mixed)
    for i in range(len(generate)):  # generation is unchanged by the embeddings in its batches
        assert results[f"g{i}"] == alone[f"g{i}"]
    for i, prompt in enumerate(embed):
        tokens, embedding = results[f"e{i}"]
        assert tokens == [] and len(embedding) == 64
        expected = reference(hf_model, prompt, kinds[i])
        torch.testing.assert_close(torch.tensor(embedding), expected, atol=1e-4, rtol=0)


def test_mean_pooling_survives_preemption(folder, hf_model):
    core = EngineCore(EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", max_model_len=64),
        cache=CacheConfig(block_size=4, num_blocks=20),  # about 76 tokens of KV for everyone
        scheduler=SchedulerConfig(max_num_batched_tokens=16),
        device=DeviceConfig(device="cpu", attention_backend="torch"),
    ))
    pooling = PoolingParams(PoolingType.MEAN, normalize=False)
    generate = prompts([20, 24], seed=3)
    embed = prompts([40], seed=4)
    requests = [EngineCoreRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
                for i, p in enumerate(generate)] + [EngineCoreRequest("e0", embed[0], POOLED, pooling=pooling)]
    stats = []
    results = run(core, requests, stats)
    assert sum(s.num_preemptions for s in stats) > 0
    torch.testing.assert_close(torch.tensor(results["e0"][1]), reference(hf_model, embed[0], pooling),
                               atol=1e-4, rtol=0)


def test_an_input_too_long_to_embed_is_refused_without_speaking_of_generation(folder):
    core = EngineCore(EngineConfig(model=ModelConfig(model=str(folder), dtype="float32", max_model_len=16),
                                   cache=CacheConfig(block_size=4, num_blocks=16),
                                   device=DeviceConfig(device="cpu", attention_backend="torch")))
    pooled = EngineCoreRequest("e", [5] * 16, POOLED, pooling=PoolingParams(PoolingType.MEAN))
    with pytest.raises(ValueError, match="the input has 16 tokens but max_model_len is 16") as refused:
        core.validate_request(pooled)
    assert "generate" not in str(refused.value) and "at most 15 tokens to be embedded" in str(refused.value)
