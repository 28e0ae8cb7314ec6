"""`auto` chooses CPU linear kernels only within each layer's accuracy budget (kernels/accuracy_budget.py):
no more error than llama.cpp's arithmetic has on the same GGUF weights, or the weight's own dtype on a float
checkpoint. Lossier kernels run only when asked for, and then the engine names them."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine_core.config import CacheConfig, EngineConfig, ModelConfig
from engine_core.engine_core import EngineCore
from kernels import accuracy_budget
from kernels.cpu_linear import (
    FLOAT_KERNELS,
    KERNELS,
    LinearRole,
    _accuracy_verdict,
    _kernels_for,
    kernel_fits,
    lossy_linear_kernels,
    use_measured_linears,
)
from kernels.int8_linear import int8_vnni_supported
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
    return _accuracy_verdict(_with_weight(weight), tuple(KERNELS), role)


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
def test_on_gguf_weights_the_budget_is_llama_cpps_and_per_token_w8a8_is_past_it(role):
    verdict = verdict_on(q4_1_weight(), role)
    assert verdict.reference.startswith("llama.cpp")
    assert verdict.within("int8_blockwise") and verdict.within("int4") and verdict.within("int4_gemv")
    assert all(verdict.within(name) for name in FLOAT_KERNELS)
    lossy = {name for name in PER_TOKEN_W8A8 if name in verdict.errors and not verdict.within(name)}
    assert lossy == PER_TOKEN_W8A8 & set(verdict.errors), verdict.describe(verdict.errors)
    if role is LinearRole.OUTLIER_INPUT and "int8_grouped" in verdict.errors:
        assert not verdict.within("int8_grouped")  # one scale per 128 k still crushes an outlier's neighbours


@needs_vnni
def test_on_a_float_checkpoint_every_quantized_kernel_is_lossy():
    torch.manual_seed(1)
    verdict = verdict_on((torch.randn(256, 256) * 0.05).to(torch.bfloat16), LinearRole.ANY)
    assert verdict.reference == "bfloat16 F.linear"
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
    candidates = set(_kernels_for("auto", [weight], LinearRole.ANY))
    assert PER_TOKEN_W8A8 & candidates == set()  # int8_blockwise stands in for them on GGUF weights already ...
    assert not PER_TOKEN_W8A8 & timed and lossy_linear_kernels(model) == ()  # ... and the budget keeps it so

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
