"""The C++ int8 GEMV (kernels/csrc/int8_gemv.cpp) against the dequantized weight's product.

fp32 sums in another order than torch's, so within fp32 rounding of the sums (bf16 outputs:
their own rounding), on shapes with partial 16-column blocks, K tails of the 4-way unroll,
and row counts on both sides of the 4 rows that share one read of the weight.
"""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension
from kernels.int8_linear import dequantize_int8, prepare_int8_gemv, quantize_int8, run_int8_gemv

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
    want = x.to(dtype).double() @ dequantize_int8(q, scale).double().t() + bias.to(dtype).double()
    assert got.shape == (rows, out_features) and got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # of the outputs' largest magnitude
    assert (got.double() - want).abs().max() <= tolerance * want.abs().max()


def test_int8_gemv_reads_strided_rows_and_pads_no_output():
    weight = torch.randn(20, 48)
    wide = torch.randn(2, 100)
    x = wide[:, :48]  # row stride 100
    state = prepare_int8_gemv(weight, None)
    assert state[0].shape == (2, 48, 16)  # 20 columns -> two blocks of 16, the last zero-padded
    got = run_int8_gemv(state, x)
    want = x @ dequantize_int8(*quantize_int8(weight)).t()
    assert got.shape == (2, 20)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
