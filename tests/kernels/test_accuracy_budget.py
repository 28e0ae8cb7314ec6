"""`auto` chooses CPU linear kernels only within each layer's accuracy budget (kernels/cpu/accuracy_budget.py):
no more error than the product in the weight's own dtype. Lossier kernels run only when asked for, and then
the engine names them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine_core.config import CacheConfig, EngineConfig, ModelConfig
from engine_core.engine_core import EngineCore
from kernels.cpu import accuracy_budget
from kernels.cpu.int8_linear import int8_vnni_supported
from kernels.cpu.linear import (
    FLOAT_KERNELS,
    KERNELS,
    LinearRole,
    _kernels_for,
    accuracy_verdict,
    kernel_fits,
    lossy_linear_kernels,
    use_measured_linears,
)
from tests.engine_core.tiny_gguf import write_gguf_twin
from tests.engine_core.tiny_models import write_tiny_model
from tests.kernels.test_int8_blockwise import gguf

Q = GGMLQuantizationType
PER_TOKEN_W8A8 = {"int8_vnni", "int8_dynamic"}
needs_vnni = pytest.mark.skipif(not int8_vnni_supported(), reason="the int8 kernels need a CPU with AVX512-VNNI")


def q4_1_weight(out_features: int = 256, in_features: int = 256, dtype=torch.bfloat16) -> torch.Tensor:
    torch.manual_seed(0)
    return gguf(torch.randn(out_features, in_features) * 0.05, Q.Q4_1).to(dtype)


def verdict_on(weight: torch.Tensor, role: LinearRole) -> accuracy_budget.AccuracyVerdict:
    return accuracy_verdict(weight, None, tuple(KERNELS), role)


def _with_weight(weight: torch.Tensor) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data.copy_(weight)
    return linear


def test_calibration_rows_are_the_same_on_every_call():
    first = accuracy_budget.calibration_rows(96, torch.bfloat16, outliers=True)
    assert torch.equal(first, accuracy_budget.calibration_rows(96, torch.bfloat16, outliers=True))
    sizes = first.float().abs().mean(0)
    assert sizes.max() > 10 * sizes.median()  # the outlier channels are there


@needs_vnni
@pytest.mark.parametrize("role", [LinearRole.ANY, LinearRole.OUTLIER_INPUT])
def test_on_gguf_weights_the_exact_4_bit_kernels_are_within_and_rounding_activations_to_8_bits_is_not(role):
    verdict = verdict_on(q4_1_weight(), role)
    assert verdict.dtype == "bfloat16" and verdict.llama_cpp is not None
    assert verdict.within("int4") and verdict.within("int4_gemv")  # the GGUF's codes, bf16 activations
    assert all(verdict.within(name) for name in FLOAT_KERNELS)
    assert verdict.llama_cpp > 2 * verdict.budget  # llama.cpp's int8 activations move a layer further than bf16
    w8a8 = {"int8_blockwise", "int8_vnni", "int8_dynamic", "int8_grouped"} & set(verdict.errors)
    assert w8a8 and not any(verdict.within(name) for name in w8a8), verdict.describe(verdict.errors)


@needs_vnni
def test_on_a_float_checkpoint_every_quantized_kernel_is_lossy():
    torch.manual_seed(1)
    verdict = verdict_on((torch.randn(256, 256) * 0.05).to(torch.bfloat16), LinearRole.ANY)
    assert verdict.dtype == "bfloat16" and verdict.llama_cpp is None
    assert [name for name in verdict.errors if verdict.within(name)] == []  # int8 and int4 round the weights


@needs_vnni
def test_auto_never_times_a_kernel_past_the_budget_and_int8_runs_them_named():
    weight = q4_1_weight()
    timed: set[str] = set()

    def recording(kernel, rows, fn):
        timed.add(kernel)
        fn()
        return 1e-5 * (1 + len(kernel))

    model = nn.Sequential(_with_weight(weight))
    use_measured_linears(model, "auto", buckets=(32, 512), timer=recording)
    assert "int8_blockwise" in _kernels_for("auto", [weight], LinearRole.ANY)  # it fits; the budget leaves it out
    assert not {"int8_blockwise", *PER_TOKEN_W8A8} & timed and lossy_linear_kernels(model) == ()

    asked = nn.Sequential(_with_weight(weight))
    use_measured_linears(asked, "int8", buckets=(32, 512), timer=lambda kernel, rows, fn: (
        fn(), 1.0 if kernel == "int8_vnni" else 2.0)[1])  # int8_vnni wins the race it is allowed into
    assert lossy_linear_kernels(asked) == ("0: int8_vnni",)


@needs_vnni
def test_auto_on_a_float_checkpoint_keeps_float_kernels(tmp_path):
    weight = (torch.randn(256, 256) * 0.05).to(torch.bfloat16)
    model = nn.Sequential(_with_weight(weight))
    fastest_int8 = lambda kernel, rows, fn: (fn(), 1.0 if kernel.startswith("int8") else 2.0)[1]  # noqa: E731
    use_measured_linears(model, "auto", buckets=(1, 32, 512), timer=fastest_int8)
    assert {kernel for _, kernel in model[0].plan} <= set(FLOAT_KERNELS)
    assert kernel_fits("linear", weight)


@needs_vnni
@pytest.mark.parametrize("quantization, lossy", [("auto", False), ("int8", True)])
def test_get_engine_info_names_the_lossy_kernels_in_use(tmp_path, quantization, lossy):
    folder = write_tiny_model(tmp_path / "hf", hidden_size=128, intermediate_size=256)
    path = write_gguf_twin(folder, tmp_path / "tiny.gguf", Q.Q4_1)
    engine = EngineCore(EngineConfig(model=ModelConfig(model=str(path), dtype="bfloat16", quantization=quantization,
                                                      linear_kernels="*=int8_vnni" if lossy else None),
                                    cache=CacheConfig(num_blocks=64)))
    names = engine.info.lossy_linear_kernels
    assert bool(names) == lossy, names
    assert all(name.endswith(": int8_vnni") for name in names)
