"""Float linears on oneDNN-prepacked weights (kernels/cpu/onednn_linear.py) against their reference, the
float product (`float_linear`, kernels/reference/linear.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu.onednn_linear import onednn_supported, prepare_onednn, run_onednn
from kernels.reference.linear import float_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_hint", [1, 32])
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_weight_matches_linear_for_any_rows(dtype, rows_hint, rows, bias):
    if not onednn_supported(dtype):
        pytest.skip(f"this torch build or CPU has no oneDNN {dtype} linear")
    torch.manual_seed(rows)
    weight, x = torch.randn(96, 80, dtype=dtype), torch.randn(rows, 80, dtype=dtype)
    b = torch.randn(96, dtype=dtype) if bias else None
    y = run_onednn(prepare_onednn(weight, b, rows_hint), x)
    expected = float_linear(x, weight, b)
    assert y.shape == (rows, 96) and y.dtype == dtype
    # the same values in another layout: fp32 differs by summation order only; bf16 by the
    # rounding of the bf16 output (8-bit mantissa: 2^-9 relative) and of partial sums
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert (y.float() - expected).abs().max() <= tolerance * expected.abs().max()


def test_float32_is_supported_wherever_torch_has_mkldnn_and_float16_nowhere():
    assert onednn_supported(torch.float32) == torch.backends.mkldnn.is_available()
    assert not onednn_supported(torch.float16)  # CPU engines run fp32 or bf16 only
