"""The Triton fused layer ops (kernels/triton/fused_ops.py) against the torch layers they
replace, whose torch path is the reference (kernels/reference/layer_ops.py).

On a CUDA GPU they run there; without one, in Triton's CPU interpreter (tests/conftest.py).
Tolerances as for the C++ ops (tests/kernels/test_fused_ops.py): fp32 atol = rtol = 1e-5;
bf16 / fp16 one ulp of the type (the reference rounds some intermediates that the kernels
keep in fp32) with atol 1e-2 for values near zero. The interpreter casts fp32 to bf16 by
truncating, not rounding to nearest as the GPU and torch do, so there bf16 results may sit
one more ulp away (two truncated roundings in the norm and in SiLU * mul).
"""

from __future__ import annotations

import pytest
import torch

from kernels.triton.fused_ops import TritonFusedOps
from tests.kernels.fused_op_checks import check_rms_norm, check_rotary, check_silu_and_mul, randn

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOKENS = [1, 5]
INTERPRETED = DEVICE.type == "cpu"
ULP = {torch.bfloat16: 2**-6 if INTERPRETED else 2**-7, torch.float16: 2**-10}
fused = TritonFusedOps()


def assert_close(actual, expected):
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=ULP[actual.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [576, 40])  # SmolLM2's hidden size, and one short of a power of two
def test_rms_norm_and_fused_residual_add(dtype, tokens, hidden):
    # the interpreter truncates the sum where the GPU rounds it
    exact = not (INTERPRETED and dtype == torch.bfloat16)
    check_rms_norm(fused, dtype, tokens, hidden, assert_close, DEVICE, exact_residual=exact)


def test_rms_norm_reads_strided_rows():
    x = randn(3, 2, 64, dtype=torch.float32, seed=8, device=DEVICE)[:, 0]  # rows 128 apart
    weight = randn(64, dtype=torch.float32, seed=9, device=DEVICE)
    assert_close(fused.rms_norm(x, weight, 1e-6), torch.nn.functional.rms_norm(x, (64,), weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("intermediate", [1536, 40])  # 1536: more than one 1024-column block
def test_silu_and_mul(dtype, tokens, intermediate):
    check_silu_and_mul(fused, dtype, tokens, intermediate, assert_close, [-60.0, 60.0, -50.0, 0.0], DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: half a head is not a power of two
def test_rotary_on_the_qk_view_of_a_fused_projection(dtype, tokens, head_dim):
    check_rotary(fused, dtype, tokens, head_dim, assert_close, DEVICE)


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert fused.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert fused.silu_and_mul(torch.empty(0, 80, device=DEVICE)).shape == (0, 40)
