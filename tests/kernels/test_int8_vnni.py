"""The VNNI W8A8 GEMM (kernels/cpu/csrc/int8_vnni.cpp) against int8_dynamic, the same arithmetic
through torch._int_mm, and against their reference (`int8_per_token`, kernels/reference/linear.py).

Both round the activations with the same op, sum int8 products exactly in int32 and rescale with
acc * (row scale * column scale), so without a bias the outputs are the same bits; a bias add may
fuse into the multiply differently, so with one they agree to an ulp of the output.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.int8_linear import (
    int8_vnni_supported,
    int_mm_is_exact,
    prepare_int8_dynamic,
    prepare_int8_vnni,
    run_int8_dynamic,
    run_int8_vnni,
)
from kernels.reference.linear import int8_per_token

pytestmark = pytest.mark.skipif(not int8_vnni_supported(),
                                reason="int8_vnni needs the C++ kernels built for a CPU with AVX512-VNNI")


@pytest.fixture(autouse=True)
def exact_int_mm(monkeypatch):
    """The reference's int8 GEMM sums exactly: where oneDNN's saturates (its AVX2 path, as under
    ONEDNN_MAX_CPU_ISA=AVX2: `int_mm_is_exact`), exact integer sums through float64 stand in."""
    if not int_mm_is_exact():
        monkeypatch.setattr(torch, "_int_mm", lambda a, b: (a.double() @ b.double()).to(torch.int32))


# (rows, in, out): row tiles of 8 and blocks of 128 rows with tails, column groups of 48 with
# tails of whole and partial 16-column blocks
SHAPES = [(1, 576, 960), (3, 36, 100), (8, 1536, 576), (13, 64, 3072), (40, 96, 17), (131, 128, 200)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_vnni_gemm_gives_int8_dynamics_bits(dtype, rows, k, n):
    g = torch.Generator().manual_seed(rows * k + n)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    x[0, : k // 2] = 0  # uneven rows: the activation scales differ per row
    got = run_int8_vnni(prepare_int8_vnni(w, None), x)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert torch.equal(got, run_int8_dynamic(prepare_int8_dynamic(w, None), x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_gemm_adds_the_bias_and_reads_strided_rows(dtype):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(50, 64, generator=g).to(dtype), torch.randn(50, generator=g).to(dtype)
    x = torch.randn(9, 128, generator=g).to(dtype)[:, ::2]  # a column stride of 2
    got = run_int8_vnni(prepare_int8_vnni(w, b), x)
    want = run_int8_dynamic(prepare_int8_dynamic(w, b), x)
    ulp = torch.finfo(dtype).eps * want.abs().float()
    assert ((got.float() - want.float()).abs() <= ulp).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_gemm_is_its_reference_within_rounding(dtype):
    """The reference rounds the rows as the kernel does and sums in float64: the kernel's int32 sums
    are exact, so what differs is its fp32 rescale (two roundings) and the output's own rounding."""
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(100, 256, generator=g) * 0.05).to(dtype)
    x = (torch.randn(13, 256, generator=g) * 3).to(dtype)
    got = run_int8_vnni(prepare_int8_vnni(w, None), x).double()
    want = int8_per_token(x, w)
    output_rounding = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    assert ((got - want).abs() <= (2 * torch.finfo(torch.float32).eps + output_rounding) * want.abs()).all()


def test_vnni_gemm_sums_full_scale_products_exactly():
    """Every activation and weight at +-127 over K = 1536 (the largest sums a layer makes): the
    +128 offset of the unsigned operand is undone exactly, nothing saturates."""
    k, n = 1536, 32
    w = torch.full((n, k), 1.0)
    w[1::2] = -1.0
    x = torch.full((4, k), 1.0)
    x[1::2] = -1.0
    got = run_int8_vnni(prepare_int8_vnni(w, None), x)
    assert torch.equal(got, x @ w.t())
