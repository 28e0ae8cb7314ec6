"""W8A8's C++ passes (kernels/cpu/csrc/int8_rows.cpp) against the torch ops they replace: the rounding of
each row against its reference (`quantize_rows_int8`, kernels/reference/linear.py), the whole product
against int8_dynamic's torch path.

Both compute the same arithmetic in the same order (x / scale rounded half to even, then
acc * (row scale * column scale)), so without a bias the outputs are the same bits; a bias add
may fuse into the multiply (one fp32 rounding less), so with one they agree to an fp32 ulp of
the output.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension as cpu_extension
from kernels.cpu.int8_linear import _run_int8_dynamic_torch, int_mm_is_exact, prepare_int8_dynamic, run_int8_dynamic
from kernels.reference.linear import quantize_rows_int8

pytestmark = pytest.mark.skipif(not cpu_extension.load(), reason="the C++ CPU kernels need a C++ compiler")

SHAPES = [(1, 576, 960), (3, 37, 100), (8, 1536, 576), (33, 64, 3072)]  # (rows, in, out): tails of 16 lanes too


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, _", SHAPES)
def test_quantize_rows_matches_torch(dtype, rows, k, _):
    x = torch.randn(rows, k, dtype=dtype) * 3
    x[0, :] = 0  # an all-zero row: scale 1e-12, codes 0
    x[-1, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # scale 1: ties that round to even (2, -4, 0)
    q, scale = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows)
    torch.ops.tandem.quantize_rows_int8(q, scale, x)
    expected_q, expected_scale = quantize_rows_int8(x)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(q, expected_q)
    if rows > 1:
        assert q[-1, :4].tolist() == [127, 2, -4, 0]


def test_quantize_rows_reads_strided_rows():
    wide = torch.randn(4, 200)
    x = wide[:, :130]  # row stride 200
    q, scale = torch.empty(4, 130, dtype=torch.int8), torch.empty(4)
    torch.ops.tandem.quantize_rows_int8(q, scale, x)
    expected_q, expected_scale = quantize_rows_int8(x.contiguous())
    assert torch.equal(q, expected_q) and torch.equal(scale, expected_scale)


@pytest.mark.skipif(not int_mm_is_exact(), reason="this machine's int8 GEMM saturates (no VNNI): W8A8 is off here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_w8a8_through_the_cpp_passes_matches_the_torch_path(dtype, bias, rows, k, n):
    weight = torch.randn(n, k, dtype=dtype)
    state = prepare_int8_dynamic(weight, torch.randn(n, dtype=dtype) if bias else None)
    assert state[-1]  # the C++ path is the one taken
    x = torch.randn(rows, k, dtype=dtype)
    got, expected = run_int8_dynamic(state, x), _run_int8_dynamic_torch(state, x)
    assert got.dtype == expected.dtype == dtype and got.shape == (rows, n)
    if not bias:
        assert torch.equal(got, expected)
    else:  # one fp32 rounding apart, before any rounding to bf16
        ulp = torch.finfo(torch.float32).eps * expected.float().abs().clamp(min=1.0)
        step = 2 * ulp if dtype == torch.float32 else torch.finfo(torch.bfloat16).eps * expected.float().abs()
        assert ((got.float() - expected.float()).abs() <= step + 1e-6).all()


def test_scale_int32_rows_rejects_mismatched_shapes():
    out, acc = torch.empty(2, 8), torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="col_scales must be"):
        torch.ops.tandem.scale_int32_rows(out, acc, torch.ones(2), torch.ones(7), torch.empty(0))
