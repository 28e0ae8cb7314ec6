"""--kv-cache-dtype in the whole engine, on a tiny random Llama (head_dim 64, the C++ kernel's integer path): the
capacity a memory budget buys, answers within the quantization's reach of the float cache's, and the engine's
other paths over an int8 cache (prefix cache, chunked prefill, preemption, sleep and wake, embeddings,
overlapped steps, the one-op decode layers, batch-invariant mode, LoRA, speculative decoding; Triton in the slow
tier).

Equality is exact where the int8 cache is the only thing that differs from a run it is compared with: the cache
holds the same codes whichever step wrote them, so caching, chunking and preemption change no bit in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine_core.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from engine_core.engine_core import EngineCore
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import EngineCoreRequest, PoolingParams, SamplingParams
from engine_core.startup import num_blocks_for_memory
from kernels.cpu import extension as cpu_extension
from tests.engine_core.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")

VOCAB = 256
BLOCK = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-kv8"), hidden_size=256, num_heads=4, num_kv_heads=2,
                            intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=512)


def config(folder, kv="int8", *, dtype="float32", backend="cpp", num_blocks=None, memory_gib=1.0, budget=64,
           prefix_caching=True, max_num_seqs=32, overlap="off", batch_invariant=False, max_model_len=None):
    return EngineConfig(
        model=ModelConfig(model=str(folder), dtype=dtype, max_model_len=max_model_len),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, kv_cache_memory_gib=memory_gib,
                          enable_prefix_caching=prefix_caching, kv_cache_dtype=kv),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs),
        device=DeviceConfig(device="cpu", attention_backend=backend, overlap=overlap, batch_invariant=batch_invariant),
    )


def prompts(count=6, seed=0, shortest=5, longest=90):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest, (count,), generator=g).tolist()
    return [torch.randint(4, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run(core: EngineCore, prompt_list, params) -> tuple[list[list[int]], int, int]:
    """Greedy tokens per prompt, the preemptions, and the most requests running at once."""
    for i, prompt in enumerate(prompt_list):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params))
    tokens = {f"r{i}": [] for i in range(len(prompt_list))}
    preemptions = running = 0
    while core.has_unfinished_requests():
        outputs = core.step()
        preemptions += outputs.scheduler_stats.num_preemptions
        running = max(running, outputs.scheduler_stats.num_running_reqs)
        for out in outputs.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert core.scheduler.kv_cache_manager.num_free_blocks == core.info.num_blocks - 1
    return [tokens[f"r{i}"] for i in range(len(prompt_list))], preemptions, running


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


# ---- capacity -----------------------------------------------------------------------------------------------------
def test_the_same_memory_holds_and_admits_about_twice_the_tokens(folder):
    """int8 rows are head_dim codes and a 2-byte scale: 128 / 66 of bf16's tokens at head_dim 64; fp32 half."""
    blocks = {kv: EngineCore(config(folder, kv, dtype="bfloat16", memory_gib=0.002)).info.num_blocks
              for kv in ("bf16", "int8", "fp32", "auto")}
    assert blocks["auto"] == blocks["bf16"]
    assert blocks["int8"] / blocks["bf16"] == pytest.approx(128 / 66, rel=0.02)
    assert blocks["fp32"] / blocks["bf16"] == pytest.approx(0.5, rel=0.02)
    # admission: 24 requests of 64 prompt + 12 tokens each against budgets that fit a few
    many = prompts(24, seed=3, shortest=64, longest=65)
    running = {kv: run(EngineCore(config(folder, kv, dtype="bfloat16", memory_gib=0.0005, budget=2048,
                                         max_model_len=128)), many, GREEDY)[2] for kv in ("bf16", "int8")}
    assert running["int8"] >= 1.8 * running["bf16"], running


def test_the_engine_reports_its_kv_dtype_and_sizes_blocks_by_it(folder):
    core = EngineCore(config(folder, "int8"))
    assert core.info.kv_cache_dtype == "int8"
    key_cache, value_cache = core.runner.kv_caches[0]
    assert key_cache.dtype == torch.int8 and key_cache.shape[-1] == 64 + 2
    assert EngineCore(config(folder, "auto", dtype="bfloat16")).info.kv_cache_dtype == "bf16"
    arch = core.arch
    per_block = num_blocks_for_memory(config(folder, "int8"), arch, 512, torch.int8)
    assert per_block == int(2**30) // (BLOCK * arch.num_hidden_layers * 2 * 2 * 66)
    with pytest.raises(ValueError, match="multiple of 16"):
        CacheConfig(block_size=8, kv_cache_dtype="int8")


# ---- answers --------------------------------------------------------------------------------------------------------
def assert_close_to_the_float_cache(make_config, float_kv: str, lora_name: str | None = None) -> None:
    """The float cache's greedy continuation, scored by both caches (prompt log-probs, prefilled in chunks):
    int8's mean |log-prob change| is a small fraction of a nat and the top token mostly agrees."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(4, VOCAB, (100,), generator=g).tolist()
    answer = LLMEngine(make_config(float_kv)).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
        lora_names=lora_name)[0].outputs[0].token_ids
    scored = {}
    for kv in (float_kv, "int8"):
        out = LLMEngine(make_config(kv)).generate([prompt + list(answer)], SamplingParams(max_tokens=1,
                                                                                          prompt_logprobs=0),
                                                  lora_names=lora_name)[0]
        scored[kv] = [(p.logprobs[0], p.rank) for p in out.prompt_logprobs[len(prompt) - 1:]]
    changes = [abs(a[0] - b[0]) for a, b in zip(scored["int8"], scored[float_kv])]
    top = sum(rank == 1 for _, rank in scored["int8"]) / len(changes)
    assert sum(changes) / len(changes) < 0.05 and max(changes) < 0.5 and top >= 0.9, (changes, top)


@pytest.mark.parametrize("backend, dtype", [
    ("cpp", "float32"), ("cpp", "bfloat16"), ("torch", "float32"),
    pytest.param("triton", "float32", marks=[pytest.mark.slow, pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton runs on the GPU here, not in its interpreter")]),
])
def test_teacher_forced_log_probs_stay_close_to_the_float_caches(folder, backend, dtype):
    float_kv = "fp32" if dtype == "float32" else "bf16"
    assert_close_to_the_float_cache(lambda kv: config(folder, kv, dtype=dtype, backend=backend, budget=48), float_kv)


def test_a_lora_adapters_answers_stay_close_to_the_float_caches(folder, tmp_path):
    from engine_core.config import LoraConfig
    from tests.engine_core.tiny_lora import write_tiny_adapter

    # a moderate adapter: at peft's full random scale this tiny model's logits turn so peaked that int8's
    # rounding of its keys moves them by 0.09 nats on average
    adapter = write_tiny_adapter(folder, tmp_path / "adapter", rank=4, scale=0.3)

    def make_config(kv):
        base = config(folder, kv, budget=48)
        return EngineConfig(model=base.model, cache=base.cache, scheduler=base.scheduler, device=base.device,
                            lora=LoraConfig(enable=True, max_lora_rank=4, adapters={"tiny": str(adapter)}))

    assert_close_to_the_float_cache(make_config, "fp32", lora_name="tiny")


# ---- the engine's paths over an int8 cache --------------------------------------------------------------------------
def test_prefix_cache_and_chunked_prefill_change_no_bit(folder):
    shared = prompts(1, seed=7, shortest=40, longest=41)[0]
    prompt_list = [shared + p for p in prompts(5, seed=8)] + prompts(3, seed=9)
    cached, _, _ = run(EngineCore(config(folder, budget=32)), prompt_list, GREEDY)
    uncached, _, _ = run(EngineCore(config(folder, budget=512, prefix_caching=False)), prompt_list, GREEDY)
    assert cached == uncached


def test_preemption_changes_no_bit(folder):
    prompt_list = prompts(8, seed=10, shortest=20, longest=40)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    free, free_preemptions, _ = run(EngineCore(config(folder, budget=128)), prompt_list, params)
    tight, tight_preemptions, _ = run(EngineCore(config(folder, num_blocks=12, budget=128, max_model_len=96)),
                                      prompt_list, params)
    assert free_preemptions == 0 and tight_preemptions > 0
    assert tight == free


def test_sleep_and_wake_keep_the_int8_cache(folder):
    core = EngineCore(config(folder))
    prompt_list = prompts(2, seed=11)
    before, _, _ = run(core, prompt_list, GREEDY)
    core.sleep()
    assert core.runner.kv_caches == []
    core.wake_up()
    assert core.runner.kv_caches[0][0].dtype == torch.int8
    assert run(core, prompt_list, GREEDY)[0] == before


def test_overlapped_steps_give_the_same_tokens(folder):
    prompt_list = prompts(5, seed=12)
    assert run(EngineCore(config(folder, overlap="on")), prompt_list, GREEDY)[0] == \
        run(EngineCore(config(folder)), prompt_list, GREEDY)[0]


def test_embeddings_over_an_int8_cache_stay_close_to_the_float_caches(folder):
    prompt = prompts(1, seed=13, shortest=70, longest=71)[0]
    vectors = {}
    for kv in ("fp32", "int8"):
        core = EngineCore(config(folder, kv, budget=32))
        core.add_request(EngineCoreRequest("e", prompt, SamplingParams(max_tokens=1), pooling=PoolingParams()))
        while core.has_unfinished_requests():
            for out in core.step().outputs:
                if out.embedding is not None:
                    vectors[kv] = torch.tensor(out.embedding)
    assert torch.nn.functional.cosine_similarity(vectors["fp32"], vectors["int8"], dim=0) > 0.999


def test_one_op_decode_layers_answer_as_the_modules_over_an_int8_cache(folder, monkeypatch):
    from engine_core.loader import registry

    monkeypatch.setattr(registry, "wall_timer", lambda name, rows, fn: 1e-3 if name.startswith("one_op") else 2e-3)
    engine = LLMEngine(config(folder, dtype="bfloat16"))
    model = engine.engine_core.model.model
    assert model.decode_layers is not None
    prompt_list = prompts(4, seed=14)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    with_op = [(o.outputs[0].token_ids, [lp.logprobs for lp in o.outputs[0].logprobs])
               for o in engine.generate(prompt_list, params)]
    engine.engine_core.reset_prefix_cache()
    model.decode_layers = None
    without = [(o.outputs[0].token_ids, [lp.logprobs for lp in o.outputs[0].logprobs])
               for o in engine.generate(prompt_list, params)]
    assert with_op == without


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_batch_invariant_mode_keeps_its_promise_over_an_int8_cache(folder, dtype):
    engine = LLMEngine(config(folder, dtype=dtype, batch_invariant=True, budget=40, prefix_caching=True))
    prompt, *others = prompts(16, seed=15)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    seen = set()
    for size in (1, 2, 5, 16):
        engine.engine_core.reset_prefix_cache()
        out = engine.generate([prompt] + others[: size - 1], params)[0].outputs[0]
        seen.add((tuple(out.token_ids), tuple(lp.logprobs[0] for lp in out.logprobs)))
    cached = engine.generate([prompt], params)[0].outputs[0]  # its prefix now in the cache
    seen.add((tuple(cached.token_ids), tuple(lp.logprobs[0] for lp in cached.logprobs)))
    assert len(seen) == 1


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_keeps_the_greedy_output(folder, method):
    """Drafts verified as a chunk over the int8 cache give the one-token-a-step output; the draft model's own
    cache is int8 too."""
    g = torch.Generator().manual_seed(16)
    motif = torch.randint(4, VOCAB, (12,), generator=g).tolist()
    prompt_list = [motif * 4, prompts(1, seed=17)[0]]  # a repeating one, where prompt lookup drafts well
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run(EngineCore(config(folder)), prompt_list, params)[0]
    speculating = config(folder)
    speculating.speculative = SpeculativeConfig(method=method, num_speculative_tokens=3, max_batch=8,
                                                draft_model=str(folder) if method == "draft" else None)
    core = EngineCore(speculating)
    assert run(core, prompt_list, params)[0] == plain
    if method == "draft":
        assert core.runner.spec.proposer.runner.kv_caches[0][0].dtype == torch.int8
