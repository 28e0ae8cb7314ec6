"""The packed bf16 GEMM (kernels/cpu/csrc/bf16_packed.cpp) against its reference, the exact product of its
bf16 inputs (`bf16_linear`, kernels/reference/linear.py).

vdpbf16ps multiplies bf16 pairs exactly and sums in fp32, in another order than a float64
reference: the sums agree to fp32 rounding (1e-5 of the output's spread is far above it) and the
stored output to one bf16 rounding (2**-8 of each value).
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.bf16_linear import bf16_packed_supported, prepare_bf16_packed, run_bf16_packed
from kernels.reference.linear import bf16_linear

pytestmark = pytest.mark.skipif(not bf16_packed_supported(),
                                reason="the packed bf16 GEMM needs the C++ kernels built for a CPU with AVX512-BF16")

# (rows, in, out): row tiles of 8 and blocks of 128 rows with tails, column groups of 48 with
# tails of whole and partial 16-column blocks
SHAPES = [(1, 576, 960), (3, 38, 100), (8, 1536, 576), (13, 64, 3072), (40, 96, 17), (131, 128, 200)]


@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_packed_gemm_matches_the_product(rows, k, n):
    g = torch.Generator().manual_seed(rows * k + n)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
    got = run_bf16_packed(prepare_bf16_packed(w, None), x)
    want = bf16_linear(x, w)
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    bound = 2.0**-8 * want.abs() + 1e-5 * want.abs().max()
    assert ((got.double() - want).abs() <= bound).all()


def test_packed_gemm_adds_the_bias_and_reads_strided_rows():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(50, 64, generator=g).to(torch.bfloat16), torch.randn(50, generator=g).to(torch.bfloat16)
    x = torch.randn(9, 128, generator=g).to(torch.bfloat16)[:, ::2]  # a column stride of 2
    got = run_bf16_packed(prepare_bf16_packed(w, b), x)
    want = bf16_linear(x, w, b)
    assert ((got.double() - want).abs() <= 2.0**-8 * want.abs() + 1e-5 * want.abs().max()).all()
