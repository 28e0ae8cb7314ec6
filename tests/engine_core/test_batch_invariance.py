"""Batch-invariant mode (--batch-invariant): a request's greedy tokens and logprobs are the same whatever else
runs beside it. SGLang's three tests of deterministic inference (one prompt at many batch sizes, mixed
batches, shared prefixes with the cache hit and missed), plus chunked-prefill splits, on the C++ kernels
(bf16, and fp32 through the row-by-row linear) and on the Triton kernels in their CPU interpreter.

Equality here is exact on purpose: the mode promises the same bits, not answers within a tolerance.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from engine_core.loader import registry
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import SamplingParams
from engine_core.startup import batch_invariant_pins
from kernels.cpu import extension as cpu_extension
from kernels.cpu.bf16_linear import bf16_packed_supported
from kernels.cpu.decode_layers import OP_KERNELS
from tests.engine_core.test_cpu_decode_layers import timer_preferring
from tests.engine_core.tiny_models import write_tiny_model

VOCAB = 512
NEW_TOKENS = 6
MODES = [  # (attention backend, dtype)
    pytest.param("cpp", "bfloat16", id="cpp-bf16"),
    pytest.param("cpp", "float32", id="cpp-fp32"),
    # a whole engine in the interpreter takes minutes: the slow tier (tests/kernels/test_batch_invariant_attention.py
    # checks the Triton kernel itself in the fast one)
    pytest.param("triton", "bfloat16", id="triton-bf16", marks=[pytest.mark.slow, pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="Triton runs on the GPU here, not in its CPU interpreter")]),
]
pytestmark = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    # wide enough that a BLAS blocks its sums differently by batch size (what the mode must not let through)
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny"), hidden_size=256, intermediate_size=512,
                                num_heads=8, num_kv_heads=2, vocab_size=VOCAB, max_position_embeddings=512))


def engine(folder: str, backend: str, dtype: str, *, step_tokens: int = 512, prefix_caching: bool = False,
           max_num_seqs: int = 64) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=folder, dtype=dtype),
        cache=CacheConfig(block_size=16, num_blocks=512, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_batched_tokens=step_tokens, max_num_seqs=max_num_seqs),
        device=DeviceConfig(device="cpu", attention_backend=backend, batch_invariant=True),
    ))


def random_prompts(count: int, seed: int, shortest: int = 3, longest: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def answers(llm: LLMEngine, prompts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    """Each prompt's greedy tokens and their logprobs."""
    outputs = llm.generate(prompts, GREEDY)
    return [(tuple(o.outputs[0].token_ids), tuple(lp.logprobs[0] for lp in o.outputs[0].logprobs)) for o in outputs]


def test_engine_reports_the_mode(model_folder):
    assert engine(model_folder, "cpp", "bfloat16").info.batch_invariant


@pytest.mark.parametrize("backend, dtype", MODES)
def test_one_prompt_at_every_batch_size_gives_one_answer(model_folder, backend, dtype):
    llm = engine(model_folder, backend, dtype)
    prompt, *others = random_prompts(32, seed=1)
    sizes = range(1, 33) if backend == "cpp" else (1, 3, 16)  # the interpreter is slow
    seen = {answers(llm, [prompt] + others[: size - 1])[0] for size in sizes}
    assert len(seen) == 1, f"{len(seen)} different answers over batch sizes {list(sizes)}"


@pytest.mark.parametrize("backend, dtype", MODES)
def test_mixed_batches_give_each_prompt_one_answer(model_folder, backend, dtype):
    """Prompts of many lengths, run in random subsets and orders, with a step budget small enough that decodes
    share steps with other prompts' prefill chunks."""
    llm = engine(model_folder, backend, dtype, step_tokens=40)
    prompts = random_prompts(12, seed=2)
    rng = random.Random(3)
    seen: dict[int, list] = {i: [] for i in range(len(prompts))}
    for _ in range(6 if backend == "cpp" else 2):
        chosen = rng.sample(range(len(prompts)), rng.randint(1, len(prompts)))
        for i, answer in zip(chosen, answers(llm, [prompts[i] for i in chosen])):
            seen[i].append(answer)
    differing = {i: len(set(runs)) for i, runs in seen.items() if len(set(runs)) > 1}
    assert not differing, f"prompts with more than one answer: {differing}"
    assert sum(len(runs) >= 2 for runs in seen.values()) >= 3, "too few prompts ran in two batches to say anything"


@pytest.mark.parametrize("backend, dtype", MODES)
def test_shared_prefix_gives_one_answer_with_the_cache_hit_or_missed(model_folder, backend, dtype):
    prefix = random_prompts(1, seed=4, shortest=40, longest=40)[0]
    tails = random_prompts(4, seed=5, shortest=1, longest=20)
    prompts = [prefix + tail for tail in tails]

    cold = engine(model_folder, backend, dtype, prefix_caching=False)
    expected = [answers(cold, [p])[0] for p in prompts]

    warm = engine(model_folder, backend, dtype, prefix_caching=True)
    first = warm.generate(prompts[:1], GREEDY)[0]
    assert first.usage.cached_tokens == 0
    hits = warm.generate(prompts[1:], GREEDY)
    assert all(o.usage.cached_tokens >= 32 for o in hits), "the shared prefix was never a cache hit"
    got = [(tuple(o.outputs[0].token_ids), tuple(lp.logprobs[0] for lp in o.outputs[0].logprobs))
           for o in [first, *hits]]
    assert got == expected


@pytest.mark.parametrize("backend, dtype", MODES)
def test_chunked_prefill_splits_give_one_answer(model_folder, backend, dtype):
    prompts = random_prompts(3, seed=6, shortest=50, longest=70)
    results = {step: answers(engine(model_folder, backend, dtype, step_tokens=step), prompts) for step in (7, 16, 512)}
    assert results[7] == results[16] == results[512]


def test_adapter_rows_get_one_answer_at_every_batch_size(model_folder, tmp_path):
    """A request on a LoRA adapter, beside base-model rows and other adapter rows: the BGMV kernel at every size."""
    from tests.engine_core.tiny_lora import write_tiny_adapter

    adapter = str(write_tiny_adapter(model_folder, tmp_path / "adapter", rank=8))
    llm = LLMEngine(EngineConfig(
        model=ModelConfig(model=model_folder, dtype="bfloat16"),
        cache=CacheConfig(block_size=16, num_blocks=512, enable_prefix_caching=False),
        device=DeviceConfig(device="cpu", attention_backend="cpp", batch_invariant=True),
        lora=LoraConfig(enable=True, adapters={"tiny": adapter}),
    ))
    prompt, *others = random_prompts(16, seed=7)
    seen = set()
    for size in (1, 2, 3, 5, 8, 16):
        outputs = llm.generate([prompt] + others[: size - 1], GREEDY,
                               lora_names=["tiny"] + ["tiny" if i % 2 else None for i in range(size - 1)])
        completion = outputs[0].outputs[0]
        seen.add((tuple(completion.token_ids), tuple(lp.logprobs[0] for lp in completion.logprobs)))
    assert len(seen) == 1, f"{len(seen)} different answers"


def test_quantization_pinned_kernels_and_cuda_are_refused(model_folder):
    with pytest.raises(ValueError, match="CPU only for now"):  # cuBLAS tiles by the batch (docs/batch-invariance.md)
        batch_invariant_pins({}, "auto", torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match="quantization 'int8' cannot be combined"):
        LLMEngine(EngineConfig(model=ModelConfig(model=model_folder, dtype="bfloat16", quantization="int8"),
                               device=DeviceConfig(device="cpu", batch_invariant=True)))
    with pytest.raises(ValueError, match="leave linear_kernels unset"):
        LLMEngine(EngineConfig(model=ModelConfig(model=model_folder, dtype="bfloat16", linear_kernels="*=linear"),
                               device=DeviceConfig(device="cpu", batch_invariant=True)))
    with pytest.raises(ValueError, match="needs the 'cpp' or 'triton' attention backend"):
        LLMEngine(EngineConfig(model=ModelConfig(model=model_folder, dtype="float32"),
                               device=DeviceConfig(device="cpu", attention_backend="torch", batch_invariant=True)))


def test_every_linear_runs_one_kernel_at_every_batch_size(model_folder, monkeypatch):
    monkeypatch.setattr(registry, "wall_timer", timer_preferring("one_op"))
    llm = engine(model_folder, "cpp", "bfloat16")
    from kernels.cpu.linear import BATCH_INVARIANT_KERNELS, CpuLinear

    model = llm.engine_core.runner.model
    linears = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert linears and all(len({name for _, name in m.plan}) == 1 for m in linears)
    assert all(m.plan[0][1] in BATCH_INVARIANT_KERNELS for m in linears)
    op = model.model.decode_layers  # where the one-op layers run, they run the same kernels and attention
    if linears[0].plan[0][1] == "linear_bf16_packed":
        assert op is not None and {kind for weights in op.weights.values() for layer in weights
                                   for kind in layer[3::5]} == {OP_KERNELS["linear_bf16_packed"]}
        assert all(attention[-1] for attention in op.attention)  # batch_invariant
    else:
        assert op is None  # linear_rowwise is not one of the op's kernels


@pytest.mark.parametrize("one_op", [True, False], ids=["one-op-layers", "modules"])
def test_decode_steps_through_the_one_op_layers_or_the_modules_give_one_answer(model_folder, monkeypatch, one_op):
    """Decode-only steps may run as one C++ op per layer (the load's timing decides; forced here both ways)
    while steps with a prefill chunk run the modules: a request's answer is the same either way."""
    monkeypatch.setattr(registry, "wall_timer", timer_preferring("one_op" if one_op else "modules"))
    llm = engine(model_folder, "cpp", "bfloat16", step_tokens=24)
    assert (llm.engine_core.runner.model.model.decode_layers is not None) == (one_op and bf16_packed_supported())
    prompt, *others = random_prompts(16, seed=8)
    alone = engine(model_folder, "cpp", "bfloat16")  # (the load's own choice of op or modules)
    expected = answers(alone, [prompt])[0]
    for size in (1, 2, 5, 16):
        assert answers(llm, [prompt] + others[: size - 1])[0] == expected, f"batch of {size}"
