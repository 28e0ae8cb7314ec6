"""The CPU's one-op decoder layers beside LoRA: they serve the steps without adapter rows and step
aside (the layers run module by module) for a step with any; the answers are the module path's."""

from __future__ import annotations

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, LoraConfig, ModelConfig, SchedulerConfig
from engine_core.llm_engine import LLMEngine
from engine_core.loader import registry
from engine_core.protocol import SamplingParams
from kernels import cpu_extension
from tests.engine_core.test_cpu_decode_layers import timer_preferring
from tests.engine_core.tiny_lora import write_tiny_adapter
from tests.engine_core.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")


@pytest.fixture(scope="module")
def model_and_adapter(tmp_path_factory):
    base = write_tiny_model(tmp_path_factory.mktemp("tiny-llama-op-lora"), num_layers=2, vocab_size=256)
    return base, write_tiny_adapter(base, tmp_path_factory.mktemp("op-adapter"), rank=4, seed=5)


def test_one_op_layers_step_aside_for_adapter_rows(model_and_adapter, monkeypatch):
    base, adapter = model_and_adapter
    import kernels.cpu_linear as cpu_linear

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
    assert layers_op is not None
    steps = []  # (rows, whether the step had adapter rows) of every call of the op

    def counting(h, *args):
        steps.append((h.shape[0], model.lora.active))
        return layers_op(h, *args)

    counting.max_rows = layers_op.max_rows
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 256, (n,), generator=g).tolist() for n in (3, 9, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def answers(lora_names):
        return [o.completions[0].token_ids for o in engine.generate(prompts, params, lora_names=lora_names)]

    model.decode_layers = counting
    base_only, mixed = answers(None), answers([None, "x", None])
    model.decode_layers = None
    assert answers(None) == base_only and answers([None, "x", None]) == mixed  # the module path's answers
    assert steps and not any(active for _, active in steps)  # never run with adapter rows in the step
    assert (3, False) in steps  # but it served the base-only decode steps
    assert mixed[1] != base_only[1] and mixed[0] == base_only[0]
