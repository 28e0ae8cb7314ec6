"""The C++ int4 GEMV (kernels/cpu/csrc/int4_gemv.cpp) against the dequantized weight's product (its
reference, `int4_weight_only` in kernels/reference/linear.py).

Its weight is `quantize_int4`'s (kernels/cpu/int4_linear.py) with each group's scale and min kept in
fp16: each moves by at most 2^-11 of itself, so an output moves by at most 2^-11 times
sum_k |x_k| (15 |scale| + |min|) over its column's groups. Its activations are int8_gemv's
16-bit rows (max|x_row| / 65024 at most per element) and its sums exact integers per group, then
fp32. bf16 outputs: their own rounding. Shapes with partial 16-column blocks, units of 4 blocks
with short tails, and row counts across the tiles (1 row x 4 blocks, 2 x 2, 3 and 4 x 1, two
passes of 4 rows).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension as cpu_extension
from kernels.cpu.int4_linear import dequantize_int4, prepare_int4_gemv, quantize_int4, run_int4_gemv
from kernels.cpu.int8_linear import int8_vnni_supported
from kernels.reference.linear import int4_weight_only

pytestmark = pytest.mark.skipif(not (cpu_extension.load() and int8_vnni_supported()),
                                reason="int4_gemv needs the C++ kernels built for AVX512-VNNI")

FP16_STEP = 2.0**-11  # relative rounding of an fp16 scale or min


def bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """[rows, out]: what fp16 scales and mins and 16-bit activations may move each output by."""
    codes, scales, zeros = quantize_int4(weight)
    mins = zeros - 8 * scales
    groups = scales.shape[1]
    per_group = (15 * scales.abs() + mins.abs()).double()  # [out, groups]: a weight's largest share
    x_groups = x.double().abs().reshape(x.shape[0], groups, -1).sum(-1)  # [rows, groups]
    w = dequantize_int4(codes, scales, zeros).double()
    sixteen_bits = (x.double().abs().amax(dim=1, keepdim=True) / 65024) * w.abs().sum(dim=1)
    return FP16_STEP * (x_groups @ per_group.t()) + sixteen_bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (37, 32), (1000, 160)])
def test_int4_gemv_matches_the_dequantized_product(dtype, rows, out_features, in_features):
    torch.manual_seed(rows * out_features)
    weight, bias = torch.randn(out_features, in_features) * 0.05, torch.randn(out_features)
    weight = weight.to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    state = prepare_int4_gemv(weight, bias.to(dtype))
    got = run_int4_gemv(state, x)
    want = int4_weight_only(x, weight, bias.to(dtype))
    assert got.shape == (rows, out_features) and got.dtype == dtype
    rounding = 1e-5 if dtype == torch.float32 else 2**-8  # fp32 sums / bf16 outputs, of the largest output
    assert ((got.double() - want).abs() <= rounding * want.abs().max() + bound(x, weight)).all()


def test_the_packing_puts_each_code_where_the_kernel_reads_it():
    """Unit activations pick single input columns: out[:, n] = x . w[n] for x = e_k is w[n, k]."""
    torch.manual_seed(0)
    weight = torch.randn(20, 64) * 0.1  # two blocks of 16, the last zero-padded; two groups
    state = prepare_int4_gemv(weight, None)
    packed = state[0]
    assert packed.shape == (2, 2, 320) and packed.dtype == torch.uint8  # [blocks, groups, codes + fp16 pairs]
    pairs = packed[..., 256:].contiguous().view(torch.float16).reshape(2, 2, 2, 16)
    assert not pairs[1, :, :, 4:].any()  # padding columns: no scale, no min
    assert pairs[0, :, 0].abs().min() > 0  # the real columns' scales
    x = torch.eye(64)
    got = run_int4_gemv(state, x)  # [64 rows, 20]: row k is column k of the weight
    want = int4_weight_only(x, weight)
    assert ((got.double() - want).abs() <= 1e-6 * want.abs().max() + bound(x, weight)).all()


def test_int4_gemv_reads_strided_rows():
    weight = torch.randn(48, 96) * 0.05
    wide = torch.randn(3, 200)
    x = wide[:, :96]  # row stride 200
    got = run_int4_gemv(prepare_int4_gemv(weight, None), x)
    want = int4_weight_only(x, weight)
    assert ((got.double() - want).abs() <= 1e-5 * want.abs().max() + bound(x, weight)).all()


def test_int4_gemv_rejects_a_partial_group():
    state = prepare_int4_gemv(torch.randn(16, 64), None)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tandem.int4_gemv(torch.empty(1, 16), torch.randn(1, 48), state[0])
