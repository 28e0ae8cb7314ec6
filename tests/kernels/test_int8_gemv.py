"""The C++ int8 GEMV (kernels/cpu/csrc/int8_gemv.cpp) against the dequantized weight's product (its
reference, `int8_weight_only` in kernels/reference/linear.py).

Two paths: fp32 sums in another order than torch's, so within fp32 rounding of the sums; and,
with AVX512-VNNI where K is a multiple of 4, exact integer sums over each row of x rounded to
16 bits (|xq| <= 32512): each x moves by at most half a step, max|x_row| / 65024, so an output
moves by at most that times the sum of its column's |weights|, on top of fp32 rounding. bf16
outputs: their own rounding. Shapes with partial 16-column blocks, K tails of the 4-way unroll
and K not a multiple of 4 (the fp32 path), row counts on both sides of the 4 rows that share
one read of the weight (8 byte rows, 4 x rows, per VNNI tile).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension as cpu_extension
from kernels.cpu.int8_linear import dequantize_int8, prepare_int8_gemv, quantize_int8, run_int8_gemv
from kernels.reference.linear import int8_weight_only

pytestmark = pytest.mark.skipif(not cpu_extension.load(), reason="the C++ CPU kernels need a C++ compiler")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("out_features, in_features", [(96, 64), (37, 23), (1000, 130)])
def test_int8_gemv_matches_the_dequantized_product(dtype, rows, out_features, in_features):
    torch.manual_seed(rows * out_features)
    weight, bias = torch.randn(out_features, in_features), torch.randn(out_features)
    x = torch.randn(rows, in_features)
    state = prepare_int8_gemv(weight.to(dtype), bias.to(dtype))
    got = run_int8_gemv(state, x.to(dtype))
    q, scale = quantize_int8(weight.to(dtype))
    w = dequantize_int8(q, scale).double()
    xd = x.to(dtype).double()
    want = int8_weight_only(x.to(dtype), weight.to(dtype), bias.to(dtype))
    assert got.shape == (rows, out_features) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # of the outputs' largest magnitude
    sixteen_bits = (xd.abs().amax(dim=1, keepdim=True) / 65024) * w.abs().sum(dim=1)  # [rows, out]
    assert ((got.double() - want).abs() <= tolerance * want.abs().max() + sixteen_bits).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_gemv_keeps_small_activations_beside_an_outlier(dtype):
    """One activation 1000x the others (down_proj's inputs have such channels): the 16-bit path's
    step is 1000 / 32512, still finer than bf16's own rounding of the outlier."""
    torch.manual_seed(0)
    weight, x = torch.randn(64, 256), torch.randn(2, 256)
    x[:, 7] = 1000.0
    state = prepare_int8_gemv(weight.to(dtype), None)
    got = run_int8_gemv(state, x.to(dtype)).double()
    want = int8_weight_only(x.to(dtype), weight.to(dtype))
    without_outlier = want - x[:, 7:8].double() * dequantize_int8(*quantize_int8(weight.to(dtype)))[:, 7].double()
    # well within what the rest of the row contributes, and bf16's rounding of the result
    assert (got - want).abs().max() <= 0.02 * without_outlier.abs().max() + (0 if dtype == torch.float32 else
                                                                             2**-8 * want.abs().max())


def test_int8_gemv_reads_strided_rows_and_pads_no_output():
    weight = torch.randn(20, 48)
    wide = torch.randn(2, 100)
    x = wide[:, :48]  # row stride 100
    state = prepare_int8_gemv(weight, None)
    # 20 columns -> two blocks of 16, the last zero-padded: [2, 48, 16] int8 or, VNNI, [2, 12, 16, 4] uint8
    assert state[0].shape in ((2, 48, 16), (2, 12, 16, 4))
    got = run_int8_gemv(state, x)
    want = int8_weight_only(x, weight).float()
    assert got.shape == (2, 20)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)  # 16-bit x: up to ~3e-4 here
