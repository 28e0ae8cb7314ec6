"""down_proj's W8A8 GEMM (kernels/cpu/csrc/int8_grouped.cpp): activations rounded to int8 per token and
group of ACTIVATION_GROUP k, each group's exact int32 sums added in fp32 with its scale.

Against its reference (`int8_grouped`, kernels/reference/linear.py), the same rounding in float64:
the int32 sums are exact, so what differs is the fp32 adding of the groups (a few ulp of fp32) and
the output's own rounding.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.int8_linear import (
    ACTIVATION_GROUP,
    dequantize_int8,
    int8_grouped_fits,
    int8_vnni_supported,
    prepare_int8_grouped,
    prepare_int8_vnni,
    quantize_int8,
    run_int8_grouped,
    run_int8_vnni,
)
from kernels.reference.linear import int8_grouped

pytestmark = pytest.mark.skipif(not int8_vnni_supported(),
                                reason="int8_grouped needs the C++ kernels built for a CPU with AVX512-VNNI")

# (rows, in, out): register tiles of 4 rows inside 8-row tiles and 128-row blocks, with tails;
# column groups of 48 with whole and partial 16-column blocks; one group of k and several
SHAPES = [(1, 128, 16), (3, 256, 100), (8, 1536, 576), (13, 384, 3072), (40, 128, 17), (131, 256, 200), (600, 512, 48)]


def within_rounding(got: torch.Tensor, want: torch.Tensor) -> bool:
    """fp32: a few ulp of the sums' magnitude; bf16: half an ulp of the output, plus that."""
    dtype = got.dtype
    fp32_slack = 8 * torch.finfo(torch.float32).eps * want.abs().max()
    output_rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2 * want.abs()
    return bool(((got.double() - want).abs() <= output_rounding + fp32_slack).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_grouped_gemm_rounds_each_group_of_k_on_its_own(dtype, rows, k, n):
    g = torch.Generator().manual_seed(rows * k + n)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    x[0, : k // 2] = 0  # a row with zero groups: their scale is the floor, their sums 0
    got = run_int8_grouped(prepare_int8_grouped(w, None), x)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert within_rounding(got, int8_grouped(x.float(), w.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_adds_the_bias_and_reads_strided_rows(dtype):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(50, 256, generator=g).to(dtype), torch.randn(50, generator=g).to(dtype)
    wide = torch.randn(9, 512, generator=g).to(dtype)
    for x in (wide[:, :256], wide[:, ::2]):  # a row stride of 512; a column stride of 2
        got = run_int8_grouped(prepare_int8_grouped(w, b), x)
        want = int8_grouped(x.float(), w.float(), b)
        assert within_rounding(got, want)


def test_grouped_gemm_sums_full_scale_products_exactly():
    """Every activation and weight at +-127 over K = 1536 (the largest sums a layer makes): each
    group's +128 offset is undone exactly, nothing saturates."""
    k, n = 1536, 32
    w = torch.full((n, k), 1.0)
    w[1::2] = -1.0
    x = torch.full((4, k), 1.0)
    x[1::2] = -1.0
    assert torch.equal(run_int8_grouped(prepare_int8_grouped(w, None), x), x @ w.t())


def test_an_outlier_channel_coarsens_only_its_own_group():
    """A channel 50x the others (SiLU·mul products feeding down_proj have such channels): one scale
    per token rounds every other channel to a few levels; a scale per group of 128 keeps them. The
    outlier's group is left out of the sums (zero weights), so what is measured is the rounding of
    the other groups."""
    g = torch.Generator().manual_seed(1)
    k, n, outlier = 1536, 64, 300
    w = dequantize_int8(*quantize_int8(torch.randn(n, k, generator=g) * 0.05))  # int8-exact: activations' error only
    first = outlier // ACTIVATION_GROUP * ACTIVATION_GROUP
    w[:, first:first + ACTIVATION_GROUP] = 0
    x = torch.randn(16, k, generator=g)
    x[:, outlier] *= 50
    exact = x.double() @ w.double().t()
    per_token = (run_int8_vnni(prepare_int8_vnni(w, None), x).double() - exact).abs().mean()
    grouped = (run_int8_grouped(prepare_int8_grouped(w, None), x).double() - exact).abs().mean()
    assert grouped * 8 < per_token, (float(grouped), float(per_token))


def test_the_kernel_takes_only_whole_groups_of_k():
    assert int8_grouped_fits(torch.empty(8, 2 * ACTIVATION_GROUP))
    assert not int8_grouped_fits(torch.empty(8, ACTIVATION_GROUP + 4))
    with pytest.raises(RuntimeError, match="multiple of"):
        prepare_int8_grouped(torch.randn(8, 96), None)
