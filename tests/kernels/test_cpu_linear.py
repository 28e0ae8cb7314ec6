"""CPU linear kernels (kernels/cpu/linear.py): each kernel against the float product of the weight it
holds (kernels/reference/linear.py), the int8 round trip, selection by measurement with a fake timer,
and int8 models against their dequantized twin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine_core.loader.registry import prepare_for_cpu
from engine_core.loader.safetensors import load_hf
from engine_core.models.llama import LlamaForCausalLM
from kernels import LinearRole, select_backend
from kernels.cpu.int4_linear import dequantize_int4, quantize_int4
from kernels.cpu.int8_blockwise import dequantize_blockwise, quantize_blockwise
from kernels.cpu.linear import (
    BLOCKWISE_KERNELS,
    FLOAT_KERNELS,
    GROUPED_KERNELS,
    INT4_KERNELS,
    INT8_KERNELS,
    KERNELS,
    W8A8_KERNELS,
    CpuLinear,
    allowed_kernels,
    choose_plan,
    dequantize_int8,
    int_mm_is_exact,
    kernel_fits,
    quantize_int8,
    use_measured_linears,
)
from kernels.cpu.linear_timing import fastest
from kernels.cpu.plan import fastest_float_dtype
from kernels.reference.linear import float_linear
from tests.engine_core.tiny_models import PagedBatch, run_step, write_tiny_model


def fixed_timer(costs: dict[str, float]):
    """A deterministic timer: runs the candidate (so every kernel really executes) and reports
    costs[kernel] (scaled by rows) instead of the wall clock."""
    def timer(kernel, rows, fn):
        fn()
        return costs[kernel] * rows
    return timer


# ---- quantization ----

def test_int8_round_trip_error_is_at_most_half_a_step_per_channel():
    w = torch.randn(64, 48) * torch.linspace(0.01, 3.0, 64)[:, None]  # channels of very different ranges
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127 and scale.shape == (64,)
    error = (dequantize_int8(q, scale) - w).abs()
    assert (error <= scale[:, None] / 2 + 1e-6).all()  # round-to-nearest on each channel's own grid
    assert torch.equal(quantize_int8(dequantize_int8(q, scale))[0], q)  # a quantized weight is a fixed point


# ---- each kernel against the reference ----

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_matches_linear_on_its_own_weights(kernel, rows, dtype):
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 96), torch.randn(96), torch.randn(rows, 96)
    if kernel in INT8_KERNELS:
        w = dequantize_int8(*quantize_int8(w))  # what the int8 kernels hold exactly
    if kernel in BLOCKWISE_KERNELS:
        w = dequantize_blockwise(*quantize_blockwise(w))  # int8_blockwise: its own blocks of 32
    if kernel in INT4_KERNELS:
        w = dequantize_int4(*quantize_int4(w))
    w, b, x = w.to(dtype), b.to(dtype), x.to(dtype)
    if not kernel_fits(kernel, w):
        pytest.skip(f"{kernel} does not take {dtype} weights on this machine")
    y = KERNELS[kernel][1](KERNELS[kernel][0](w, b), x)
    expected = float_linear(x, w, b)
    assert y.shape == (rows, 96) and y.dtype == dtype
    # fp32: summation order only. bf16: bf16 rounding of inputs/outputs (8 bits of mantissa).
    # W8A8 (int8_dynamic, int8_vnni) also rounds each activation row to 8 bits: up to half a step
    # of the row's amax/127 per product, so compare at 3% of the output's spread (int8_blockwise:
    # each block of 32 of the row, finer).
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[dtype]
    if kernel in W8A8_KERNELS + BLOCKWISE_KERNELS:
        tolerance = 3e-2
    if kernel == "int4":  # bf16 activations and scales whatever the dtype (its fp32 path is slow)
        tolerance = 2e-2
    if kernel == "int4_gemv" and dtype == torch.float32:  # fp16 scales and mins: 2^-11 of each
        tolerance = 2e-3
    spread = expected.abs().max()
    assert (y.float() - expected).abs().max() <= tolerance * spread


# ---- choosing ----

def test_allowed_kernels_follow_the_quantization_setting():
    assert allowed_kernels("none") == FLOAT_KERNELS
    assert allowed_kernels("int8") == INT8_KERNELS
    assert allowed_kernels("auto") == FLOAT_KERNELS + INT8_KERNELS  # each timed; int4 added where exact
    assert allowed_kernels("int4") == INT4_KERNELS + INT8_KERNELS  # int8 for shapes int4 cannot pack
    with pytest.raises(ValueError, match="quantization must be one of"):
        allowed_kernels("int3")


def test_fastest_takes_each_candidate_minimum_across_interleaved_rounds():
    noise = {"a": iter([9.0, 5.0, 1.0, 5.0]), "b": iter([9.0, 2.0, 2.0, 2.0])}  # warm-up, then 3 rounds
    best = fastest({"a": lambda: None, "b": lambda: None}, rows=1,
                   timer=lambda kernel, rows, fn: next(noise[kernel]), min_rounds=3, budget_s=0.0)
    assert best == {"a": 1.0, "b": 2.0}


def test_choose_plan_keeps_the_fastest_kernel_per_bucket(monkeypatch):
    import kernels.cpu.linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "int_mm_is_exact", lambda: True)  # a candidate even where it saturates
    weights = [(torch.randn(32, 16), None) for _ in range(3)]
    # costs scale with rows except int8_dynamic, flat: it loses at 1 row and wins from 8 on
    costs = {"linear": 1.0, "linear_colmajor": 2.0, "linear_onednn": 1.5, "int8_weight_only": 0.5, "int8_gemv": 0.6,
             "linear_rowwise": 4.0}
    kernels = tuple(k for k in KERNELS if kernel_fits(k, weights[0][0]) and k != "int8_vnni")  # int4 cannot pack 32x16
    assert "int4" not in kernels
    def timer(kernel, rows, fn):
        fn()
        return 3.0 if kernel == "int8_dynamic" else costs[kernel] * rows
    plan, timings, _ = choose_plan(weights, kernels, buckets=(1, 8, 32), timer=timer)
    assert plan == [(1, "int8_weight_only"), (8, "int8_dynamic"), (32, "int8_dynamic")]
    assert set(timings) == {1, 8, 32} and set(timings[1]) == set(kernels)


@pytest.mark.parametrize("rounding", [torch.bfloat16, torch.float16])
def test_a_float_kernel_that_rounds_below_the_weights_dtype_is_never_timed(monkeypatch, rounding):
    """An fp32 kernel that multiplies in bf16 or fp16 (as oneDNN may under a reduced fpmath mode) is
    dropped from the race however fast it is; fp32 is what an fp32 model asked for."""
    import kernels.cpu.linear as cpu_linear

    def rounded(state, x):
        w, b = state
        return F.linear(x.to(rounding).float(), w.to(rounding).float(), b)

    monkeypatch.setitem(cpu_linear.KERNELS, "linear_colmajor", (KERNELS["linear"][0], rounded))
    weights = [(torch.randn(64, 576), None)]
    def timer(kernel, rows, fn):
        fn()
        return 1.0 if kernel == "linear_colmajor" else 2.0
    plan, timings, _ = choose_plan(weights, ("linear", "linear_colmajor"), buckets=(1, 32), timer=timer)
    assert plan == [(1, "linear"), (32, "linear")]
    assert set(timings[1]) == set(timings[32]) == {"linear"}


def test_a_small_batch_kernel_is_never_planned_above_its_rows(monkeypatch):
    """A kernel in MAX_ROWS (int8_vnni: 32) is not timed at larger buckets, however fast: the last
    bucket's kernel serves every larger batch too, prefill chunks its timing never saw."""
    import kernels.cpu.linear as cpu_linear

    monkeypatch.setitem(cpu_linear.KERNELS, "small_batch", KERNELS["linear"])
    monkeypatch.setitem(cpu_linear.MAX_ROWS, "small_batch", 8)
    weights = [(torch.randn(32, 16), None)]
    def timer(kernel, rows, fn):
        fn()
        return 1.0 if kernel == "small_batch" else 2.0
    plan, timings, _ = choose_plan(weights, ("linear", "small_batch"), buckets=(1, 8, 32), timer=timer)
    assert plan == [(1, "small_batch"), (8, "small_batch"), (32, "linear")]
    assert set(timings[32]) == {"linear"}


def test_cpu_linear_dispatches_on_rows_and_keeps_only_the_formats_it_uses():
    w = torch.randn(24, 16)
    layer = CpuLinear(w, None, [(1, "int8_weight_only"), (8, "linear")])
    assert [layer.kernel_for(n) for n in (1, 2, 8, 500)] == ["int8_weight_only", "linear", "linear", "linear"]
    assert set(layer._states) == {"int8_weight_only", "linear"}
    x = torch.randn(3, 4, 16)  # leading dims are flattened and restored
    torch.testing.assert_close(layer(x), F.linear(x, w))


def test_use_measured_linears_replaces_every_linear_with_one_plan_per_shape():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16, bias=False),
                                torch.nn.Linear(16, 32))
    x = torch.randn(5, 16)
    expected = model(x)
    plans = use_measured_linears(model, "none", buckets=(1, 8),
                                 timer=fixed_timer({"linear": 2.0, "linear_colmajor": 1.0, "linear_onednn": 3.0}))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert plans == {(32, 16): [(1, "linear_colmajor"), (8, "linear_colmajor")],
                     (16, 32): [(1, "linear_colmajor"), (8, "linear_colmajor")]}
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


def test_the_prefill_bucket_is_timed_for_every_linear_but_the_lm_head():
    """Prefill chunks take the largest bucket's kernel, timed at prefill-like rows (512); the LM head
    sees one row per sampling request, so timing it there would only slow the load."""
    from kernels.cpu.linear import BUCKETS, HEAD_MAX_ROWS

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(16, 32, bias=False)
            self.lm_head = torch.nn.Linear(32, 48, bias=False)

    rows_timed: dict[int, set[int]] = {}
    def timer(kernel, rows, fn):
        out = fn()
        rows_timed.setdefault(out.shape[1], set()).add(rows)
        return 1.0
    plans = use_measured_linears(Head(), "none", timer=timer, roles={"lm_head": LinearRole.OUTPUT_HEAD})
    assert max(BUCKETS) > HEAD_MAX_ROWS
    assert rows_timed[32] == set(BUCKETS) and [rows for rows, _ in plans[(32, 16)]] == list(BUCKETS)
    assert rows_timed[48] == {b for b in BUCKETS if b <= HEAD_MAX_ROWS} == {rows for rows, _ in plans[(48, 32)]}


# ---- whole models: int8 against the dequantized float model ----

def build_model(folder, dequantized: bool = False) -> LlamaForCausalLM:
    config, weights = load_hf(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, select_backend("cpu", "torch"))
    model.load_weights(weights, torch.device("cpu"), torch.float32)
    if dequantized:  # the reference: float linears holding exactly the int8 values (the LM head too)
        if model.lm_head is None:
            model.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight = torch.nn.Parameter(dequantize_int8(*quantize_int8(m.weight)), requires_grad=False)
    return model.eval()


@pytest.mark.parametrize("variant", [dict(), dict(model_type="qwen2", tie_word_embeddings=True)])
@pytest.mark.parametrize("kernel", INT8_KERNELS)
def test_int8_model_logits_match_the_dequantized_model(tmp_path, variant, kernel):
    if kernel == "int8_dynamic" and not int_mm_is_exact():
        pytest.skip("this machine's int8 GEMM saturates (no VNNI): W8A8 is never a candidate here")
    folder = write_tiny_model(tmp_path, **variant)
    reference = build_model(folder, dequantized=True)
    ours = build_model(folder)
    if not kernel_fits(kernel, reference.model.layers[0].mlp.down_proj.weight):
        pytest.skip(f"{kernel} is not a candidate on this machine")
    prepare_for_cpu(ours, "int8", timer=fixed_timer({k: 1.0 if k == kernel else 2.0 for k in INT8_KERNELS}))
    for name, layer in ours.named_modules():  # per-token W8A8 never takes down_proj (outliers); grouped only it
        if isinstance(layer, CpuLinear):
            down = name.endswith("down_proj")
            kept = (kernel in W8A8_KERNELS and down) or (kernel in GROUPED_KERNELS and not down)
            assert layer.kernel_for(1) == ("int8_weight_only" if kept else kernel), name

    sequences = [[3, 17, 42, 5, 9, 100, 7], [250, 1, 2]]
    with torch.no_grad():
        got = run_step(ours, PagedBatch(ours.config, 2, 16), list(enumerate(sequences)))
        want = run_step(reference, PagedBatch(reference.config, 2, 16), list(enumerate(sequences)))
    got, want = torch.cat(got), torch.cat(want)
    relative_rms = float((got - want).norm() / want.norm())
    if kernel not in W8A8_KERNELS + GROUPED_KERNELS + BLOCKWISE_KERNELS:
        # weight-only: the dequantized model's matmuls, summation order aside, and for int8_gemv on
        # AVX512-VNNI activations rounded to 16 bits per row (2^-16 of the row's largest value, ~1e-4
        # of the logits here after 2 layers)
        tolerance = 1e-3 if kernel == "int8_gemv" else 1e-4
        assert (got - want).abs().max() <= tolerance * want.abs().max()
    else:
        # W8A8 rounds each activation row (or group of 128 k of it, down_proj's; or block of 32 k,
        # int8_blockwise's, whose weight is its own Q8_0 rounding of the float one) to 8 bits too: ~0.5%
        # relative error per linear, compounding over 2 layers' linears. Measured ~2%; 5% leaves room
        # for other CPUs.
        # Greedy answers on the real model: tests/engine_core/test_quantized_smollm2.py.
        assert relative_rms <= 0.05, relative_rms


# ---- dtype=auto ----

@pytest.mark.parametrize("native_bf16", [True, False])
def test_dtype_auto_keeps_the_flags_choice_unless_the_other_dtype_is_clearly_faster(native_bf16):
    expected, other = ("bfloat16", "float32") if native_bf16 else ("float32", "bfloat16")
    def timer(costs):
        return lambda name, rows, fn: costs[name.split("/")[1]]
    close = fastest_float_dtype(hidden=64, intermediate=128, native_bf16=native_bf16,
                                timer=timer({expected: 2.0, other: 1.0}))  # 2x: within shared-machine noise
    clear = fastest_float_dtype(hidden=64, intermediate=128, native_bf16=native_bf16,
                                timer=timer({expected: 4.0, other: 1.0}))
    assert (str(close), str(clear)) == (f"torch.{expected}", f"torch.{other}")


def test_w8a8_is_never_planned_where_the_int8_gemm_saturates(tmp_path, monkeypatch):
    """int_mm_is_exact() False (oneDNN's AVX2 path without VNNI sums u8 x s8 pairs in saturating
    16-bit lanes): --quantization int8 never plans torch._int_mm's W8A8. (int8_vnni, int8_grouped and
    int8_blockwise sum exactly and exist only where the CPU has VNNI; here they are the slowest candidates.)"""
    import kernels.cpu.linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "int_mm_is_exact", lambda: False)
    model = build_model(write_tiny_model(tmp_path))
    prepare_for_cpu(model, "int8", timer=fixed_timer({"int8_dynamic": 1.0, "int8_weight_only": 2.0,
                                                                "int8_gemv": 3.0, "int8_vnni": 4.0,
                                                                "int8_grouped": 4.0, "int8_blockwise": 4.0}))
    layers = [m for m in model.modules() if isinstance(m, CpuLinear)]
    assert layers and all(name == "int8_weight_only" for m in layers for _, name in m.plan)


def test_the_int8_gemm_probe_agrees_with_an_exact_product():
    """Where the probe says exact, a full-scale random int8 product is exact too (and W8A8 may run)."""
    if not int_mm_is_exact():
        pytest.skip("this machine's int8 GEMM saturates: the probe already excludes W8A8")
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-127, 128, (33, 96), dtype=torch.int8, generator=g)
    b = torch.randint(-127, 128, (96, 40), dtype=torch.int8, generator=g)
    assert torch.equal(torch._int_mm(a, b), (a.double() @ b.double()).to(torch.int32))
