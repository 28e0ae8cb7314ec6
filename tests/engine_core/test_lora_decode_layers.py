"""The CPU's one-op decoder layers beside LoRA: they serve the steps with adapter rows too, adding each
row's adapter products inside the op (kernels/cpu/csrc/lora.cpp), and give the module path's answers."""

from __future__ import annotations

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from engine_core.loader import registry
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import SamplingParams
from kernels.cpu import extension as cpu_extension
from tests.engine_core.test_cpu_decode_layers import timer_preferring
from tests.engine_core.tiny_lora import write_tiny_adapter
from tests.engine_core.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    base = write_tiny_model(tmp_path_factory.mktemp("tiny-llama-op-lora"), num_layers=2, vocab_size=256)
    return base, write_tiny_adapter(base, tmp_path_factory.mktemp("op-adapter"), rank=4, seed=5)


def test_one_op_layers_serve_adapter_rows_as_the_module_path_does(model_and_adapter, monkeypatch):
    base, adapter = model_and_adapter
    import kernels.cpu.linear as cpu_linear

    monkeypatch.setattr(registry, "wall_timer", timer_preferring("one_op", {"int8_gemv": 1.0}))
    monkeypatch.setattr(cpu_linear, "_wall_timer", timer_preferring("one_op", {"int8_gemv": 1.0}))
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(base), dtype="float32", quantization="int8"),
        cache=CacheConfig(block_size=4, num_blocks=128, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
        device=DeviceConfig(device="cpu", attention_backend="cpp"),
        lora=LoraConfig(enable=True, max_loras=2, kernel="segments", adapters={"x": str(adapter)}),
    ))
    model = engine.engine_core.model.model
    layers_op = model.decode_layers
    assert layers_op is not None and layers_op.serves_lora
    steps = []  # (rows, whether the step had adapter rows) of every call of the op

    def counting(h, *args):
        steps.append((h.shape[0], model.lora.active))
        return layers_op(h, *args)

    counting.max_rows, counting.serves_lora = layers_op.max_rows, True
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 256, (n,), generator=g).tolist() for n in (3, 9, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)

    def answers(lora_names):
        outputs = engine.generate(prompts, params, lora_names=lora_names)
        return [(o.completions[0].token_ids, [entry.logprobs for entry in o.completions[0].logprobs])
                for o in outputs]

    model.decode_layers = counting
    base_only, mixed = answers(None), answers([None, "x", None])
    model.decode_layers = None  # the module path, its LoRA products on the "segments" kernel
    for ours, modules in zip([*base_only, *mixed], [*answers(None), *answers([None, "x", None])]):
        assert ours[0] == modules[0]
        assert torch.tensor(ours[1]).sub(torch.tensor(modules[1])).abs().max().item() < 1e-4
    assert (3, True) in steps  # the op ran the decode steps with the adapter's row in them
    assert (3, False) in steps  # and the base-only ones
    assert mixed[1][0] != base_only[1][0] and mixed[0][0] == base_only[0][0]
