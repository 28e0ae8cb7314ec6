"""Decoder layers as one C++ op at small decode batches (engine_core/models/cpu_decode_layers.py).

The op calls the module path's own kernels in the same order, so its answers are the module
path's exactly (the first layer's norm(x + 0) is norm(x) bit for bit); the load-time choice
between them is tested with a fixed timer. Needs the C++ kernels (a compiler).
"""

from __future__ import annotations

import pytest
import torch

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.llm_engine import LLMEngine
from engine_core.loader import registry
from engine_core.models.cpu_decode_layers import MAX_ROWS
from engine_core.sampling_params import SamplingParams
from kernels import cpu_extension
from tests.engine_core.tiny_models import write_tiny_model

pytestmark = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")

PROMPT_LENGTHS = [3, 9, 14, 20, 6]  # prefill steps of more than MAX_ROWS rows take the modules


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-one-op"), num_layers=3, vocab_size=256)


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory):  # a sliding window shorter than the prompts: the op passes it on
    return write_tiny_model(tmp_path_factory.mktemp("tiny-mistral-one-op"), model_type="mistral", num_layers=2,
                            vocab_size=256, sliding_window=8, head_dim=16)


def timer_preferring(winner: str):
    """A load-time timer under which `winner` ('one_op' or 'modules') is twice as fast."""
    def timer(kernel, rows, fn):
        fn()  # both paths really run
        return 1e-3 if kernel == winner else 2e-3
    return timer


def make_engine(folder, monkeypatch, winner="one_op", dtype="float32", quantization="int8", enforce_eager=False):
    monkeypatch.setattr(registry, "wall_timer", timer_preferring(winner))
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(folder), dtype=dtype, quantization=quantization),
        cache=CacheConfig(block_size=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8),
        device=DeviceConfig(device="cpu", attention_backend="cpp", enforce_eager=enforce_eager),
    ))


def generate(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    engine.engine_core.reset_prefix_cache()
    outputs = engine.generate(prompts, params)
    return [(o.outputs[0].token_ids, [(lp.token_ids, lp.logprobs) for lp in o.outputs[0].logprobs]) for o in outputs]


@pytest.mark.parametrize("family, dtype", [("llama", "float32"), ("llama", "bfloat16"), ("mistral", "bfloat16")])
def test_one_op_layers_answer_exactly_as_the_modules(request, monkeypatch, family, dtype):
    folder = request.getfixturevalue("tiny_model_dir" if family == "llama" else "tiny_mistral_dir")
    engine = make_engine(folder, monkeypatch, dtype=dtype)
    model = engine.engine_core.model.model
    layers_op = model.decode_layers
    assert layers_op is not None and layers_op.max_rows == MAX_ROWS
    for layer in model.layers:  # the buckets the op serves run the GEMV on the module path too
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert linear.kernel_for(1) == linear.kernel_for(MAX_ROWS) == "int8_gemv"

    rows_seen = []

    def counting(h, *args):
        rows_seen.append(h.shape[0])
        return layers_op(h, *args)

    model.decode_layers = counting
    model.decode_layers.max_rows = MAX_ROWS
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    with_op = generate(engine, prompts)
    assert rows_seen and max(rows_seen) <= MAX_ROWS and len(PROMPT_LENGTHS) in rows_seen  # the decode steps
    model.decode_layers = None
    assert generate(engine, prompts) == with_op


def test_the_modules_stay_where_they_measure_faster(tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir, monkeypatch, winner="modules")
    assert engine.engine_core.model.model.decode_layers is None


@pytest.mark.parametrize("setting", [{"quantization": "none"}, {"enforce_eager": True}])
def test_no_op_without_the_gemv_or_the_fused_ops(tiny_model_dir, monkeypatch, setting):
    engine = make_engine(tiny_model_dir, monkeypatch, **setting)
    assert engine.engine_core.model.model.decode_layers is None


def test_no_op_for_layers_it_does_not_cover(tmp_path, monkeypatch):
    folder = write_tiny_model(tmp_path / "qwen3", model_type="qwen3", vocab_size=256)  # q/k norms
    engine = make_engine(folder, monkeypatch)
    assert engine.engine_core.model.model.decode_layers is None
