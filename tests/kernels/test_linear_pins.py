"""Kernels pinned by the user (`--linear-kernels`, ModelConfig.linear_kernels) instead of timed
(kernels/cpu/linear.py): a pinned plan is the one that runs, it is never timed nor cached, the decoder
layers' one-op path never swaps it, and a spec the model cannot take fails at load naming the choices."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_core.config import (
    LINEAR_BUCKETS,
    LINEAR_KERNELS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    parse_linear_kernels,
)
from engine_core.loader import registry
from kernels.cpu import extension as cpu_extension
from kernels.cpu import linear as cpu_linear
from kernels.cpu import linear_plan_cache
from kernels.cpu.linear import BUCKETS, KERNELS, CpuLinear, LinearRole, kernel_fits, use_measured_linears
from tests.engine_core.tiny_models import write_tiny_model
from tests.kernels.test_linear_plan_cache import install_clock


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TANDEM_REMEASURE", raising=False)


def steady_clock(kernel, rows, fn):
    fn()
    return 1e-5 * (1 + len(kernel))


def no_timing(kernel, rows, fn):
    raise AssertionError(f"{kernel} was timed at {rows} rows")


class TinyBlock(nn.Module):
    """Attribute names as the models give them, roles as they name them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.o_proj = nn.Linear(64, 64, bias=False)
        self.down_proj = nn.Linear(96, 64, bias=False)
        self.lm_head = nn.Linear(64, 80, bias=False)


ROLES = {"lm_head": LinearRole.OUTPUT_HEAD, "down_proj": LinearRole.OUTLIER_INPUT}


def test_the_flag_parser_names_the_kernels_and_buckets_of_the_kernels():
    assert LINEAR_KERNELS == tuple(KERNELS) and LINEAR_BUCKETS == BUCKETS


def test_a_later_item_overrides_an_earlier_one():
    pins = parse_linear_kernels(" *=linear, o_proj@512=linear_colmajor ,o_proj@512=linear_onednn,down_proj@8=int4,"
                                "down_proj=int4_gemv")
    assert pins == {"*": {None: "linear"}, "o_proj": {512: "linear_onednn"}, "down_proj": {None: "int4_gemv"}}
    assert parse_linear_kernels(None) == parse_linear_kernels("") == {}


@pytest.mark.parametrize("spec, named", [
    ("o_proj=int9", "int8_gemv"),  # an unknown kernel: the message lists them
    ("o_proj@64=linear", "1, 8, 32, 128, 512"),  # not a bucket: the message lists them
    ("o_proj", "LAYER[@ROWS]=KERNEL"),
])
def test_a_bad_spec_fails_on_construction_naming_the_choices(spec, named):
    with pytest.raises(ValueError, match="linear kernels") as failure:
        ModelConfig(linear_kernels=spec)
    assert named in str(failure.value)


def test_the_engine_flag_reaches_the_config():
    from services.engine.__main__ import build_parser, config_from_args

    args = build_parser().parse_args(["--linear-kernels", "down_proj@1=int8_gemv"])
    assert config_from_args(args).model.linear_kernels == "down_proj@1=int8_gemv"


def test_a_pinned_plan_runs_and_is_never_timed_nor_cached():
    model = TinyBlock()
    x = torch.randn(3, 64)
    expected = model.o_proj(x)
    pins = parse_linear_kernels("*=linear_colmajor,o_proj@8=linear,lm_head=int8_weight_only,lm_head@8=linear")
    use_measured_linears(model, "none", timer=no_timing, roles=ROLES, pins=pins)
    assert [model.o_proj.kernel_for(rows) for rows in (1, 8, 32, 4096)] == [
        "linear_colmajor", "linear", "linear_colmajor", "linear_colmajor"]
    assert model.down_proj.kernel_for(1) == "linear_colmajor"
    # a pin overrides quantization none; without @ROWS it takes every bucket the head has (up to 128)
    assert [model.lm_head.kernel_for(rows) for rows in (1, 8, 32, 4096)] == [
        "int8_weight_only", "linear", "int8_weight_only", "int8_weight_only"]
    assert [rows for rows, _ in model.lm_head.plan] == [1, 8, 32, 128]
    torch.testing.assert_close(model.o_proj(x), expected)
    assert not linear_plan_cache.cache_path().exists()


def test_only_the_buckets_left_unpinned_are_timed_and_cached(monkeypatch):
    timed: dict[int, tuple[int, ...]] = {}  # out features -> the buckets timed
    real = cpu_linear.choose_plan

    def recording(weights, kernels, buckets, *args, **kwargs):
        timed[weights[0][0].shape[0]] = buckets
        return real(weights, kernels, buckets, *args, **kwargs)
    monkeypatch.setattr(cpu_linear, "choose_plan", recording)
    install_clock(monkeypatch, steady_clock)  # a quiet machine's clock: the plan is cached, as the test needs
    model = TinyBlock()
    use_measured_linears(model, "none", roles=ROLES, pins=parse_linear_kernels("o_proj=linear,lm_head@1=linear"))
    assert timed == {64: BUCKETS, 80: (8, 32, 128)}  # down_proj all, the head but its pinned bucket, o_proj none
    assert [kernel for _, kernel in model.o_proj.plan] == ["linear"] * len(BUCKETS)
    assert [rows for rows, _ in model.lm_head.plan] == [1, 8, 32, 128] and model.lm_head.kernel_for(1) == "linear"
    stored = linear_plan_cache.cache_path().read_text()
    assert "buckets=(8, 32, 128)" in stored and "64x64" not in stored  # o_proj (64x64) neither timed nor stored


@pytest.mark.parametrize("spec, message", [
    ("q_proj=linear", "no linear named 'q_proj'; its linears: o_proj, down_proj, lm_head"),
    ("lm_head@512=linear", "lm_head is planned for 512 rows never; its buckets: 1, 8, 32, 128"),
])
def test_a_pin_this_model_cannot_take_fails_at_load_naming_the_choices(spec, message):
    with pytest.raises(ValueError, match="linear kernels") as failure:
        use_measured_linears(TinyBlock(), "none", timer=no_timing, roles=ROLES, pins=parse_linear_kernels(spec))
    assert message in str(failure.value)


def test_a_kernel_that_cannot_hold_the_weight_fails_at_load_naming_those_that_can():
    weight = TinyBlock().o_proj.weight  # fp32: the bf16 GEMM never holds it
    assert not kernel_fits("linear_bf16_packed", weight)
    with pytest.raises(ValueError, match="linear_bf16_packed cannot hold o_proj's 64x64 torch.float32") as failure:
        use_measured_linears(TinyBlock(), "none", timer=no_timing, roles=ROLES,
                             pins=parse_linear_kernels("o_proj@1=linear_bf16_packed"))
    assert "the kernels that can: linear, linear_colmajor" in str(failure.value)


def test_an_in_process_engine_runs_the_pinned_plan_without_timing(tmp_path, monkeypatch):
    from engine_core.offline.llm_engine import LLMEngine

    monkeypatch.setattr(cpu_linear, "_wall_timer", no_timing)
    monkeypatch.setattr(registry, "wall_timer", no_timing)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(write_tiny_model(tmp_path / "tiny")), dtype="float32",
                          linear_kernels="*=linear_colmajor,down_proj=linear"),
        cache=CacheConfig(block_size=4, num_blocks=128), scheduler=SchedulerConfig(max_num_batched_tokens=32),
        device=DeviceConfig(device="cpu", attention_backend="torch"),
    ))
    model = engine.engine_core.model
    kinds = {name.rpartition(".")[2]: m.kernel_for(rows) for name, m in model.named_modules()
             if isinstance(m, CpuLinear) for rows in BUCKETS}
    assert kinds == {"qkv_proj": "linear_colmajor", "o_proj": "linear_colmajor", "gate_up_proj": "linear_colmajor",
                     "down_proj": "linear", "lm_head": "linear_colmajor"}


# ---- the decoder layers as one C++ op (kernels/cpu/decode_layers.py) ----

needs_compiler = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs the C++ kernels (a compiler)")


def prepared_tiny_llama(tmp_path, spec: str):
    """A tiny Llama on the C++ layer ops, its linears timed so that the op would always win and take the
    GEMV at every decode bucket, but for what `spec` pins."""
    from engine_core.loader.safetensors import load_hf
    from engine_core.models.llama import LlamaForCausalLM
    from kernels import select_backend, select_fused_ops

    config, weights = load_hf(write_tiny_model(tmp_path / "tiny-op", num_layers=2))
    with torch.device("meta"):
        model = LlamaForCausalLM(config, select_backend("cpu", "cpp"), select_fused_ops("cpu", torch.float32))
    model.load_weights(weights, torch.device("cpu"), torch.float32)

    def op_wins(kernel, rows, fn):
        fn()
        return 1.0 if kernel.startswith("one_op") else 3.0 if kernel == "modules" else 2.0
    registry.prepare_for_cpu(model.eval(), "int8", timer=op_wins, pins=parse_linear_kernels(spec))
    return model


@needs_compiler
def test_the_one_op_layers_run_a_pinned_kernel_they_can_call(tmp_path):
    from kernels.cpu.decode_layers import OP_KERNELS

    weight = nn.Linear(64, 64, bias=False).weight
    if not kernel_fits("int8_vnni", weight):
        pytest.skip("needs the AVX512-VNNI build (int8_vnni)")
    model = prepared_tiny_llama(tmp_path, "o_proj@1=int8_vnni")
    assert model.model.decode_layers is not None
    for layer, op_args in zip(model.model.layers, model.model.decode_layers.weights[1]):
        assert layer.self_attn.o_proj.kernel_for(1) == "int8_vnni"  # not swapped for the GEMV the op won with
        assert layer.mlp.down_proj.kernel_for(1) == "int8_gemv"  # unpinned: the op's GEMV
        o_kind = op_args[3 + 5]  # norms and eps, then five arguments per linear: qkv, o, ...
        assert o_kind == OP_KERNELS["int8_vnni"]


@needs_compiler
def test_the_one_op_layers_stop_below_a_pinned_kernel_they_cannot_call(tmp_path):
    model = prepared_tiny_llama(tmp_path, "down_proj@8=int8_weight_only")
    assert model.model.decode_layers is not None and model.model.decode_layers.max_rows == 1
    assert all(layer.mlp.down_proj.kernel_for(8) == "int8_weight_only" for layer in model.model.layers)
    model = prepared_tiny_llama(tmp_path, "*@1=linear")
    assert model.model.decode_layers is None
    assert all(layer.self_attn.qkv_proj.kernel_for(1) == "linear" for layer in model.model.layers)
