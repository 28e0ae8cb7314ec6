"""The C++ fused layer ops (kernels/fused_ops.py) against their reference (kernels/reference/layer_ops.py,
which the torch layers of engine_core/models/layers.py call), and the C++ argmax against its
reference, torch.argmax.

Skipped only where no C++ compiler exists. Tolerances: fp32 atol = rtol = 1e-5 (fused
multiply-adds and another summation order); bf16 rtol = 2^-7 (one bf16 ulp: the torch layers
round some intermediates to bf16 that the fused ops keep in fp32, so a value near a rounding
boundary may land one ulp away) with atol 1e-2 for values near zero.
"""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import extension as cpu_extension
from kernels.fused_ops import FusedOps, argmax, select_fused_ops
from kernels.reference import layer_ops as reference
from tests.kernels.fused_op_checks import check_rms_norm, check_rotary, check_silu_and_mul, randn

pytestmark = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 33]
# 576 is SmolLM2's hidden size; 40 is not a whole number of 16-lane vectors (the scalar tail)
HIDDEN = [576, 40]


def assert_close(actual, expected):
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), atol=1e-2, rtol=2**-7)


@pytest.fixture(scope="module")
def fused():
    ops = select_fused_ops("cpu", torch.float32)
    assert ops is not None, "a C++ compiler is present but the CPU kernels did not build (see the log)"
    return ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_and_fused_residual_add(fused, dtype, tokens, hidden):
    check_rms_norm(fused, dtype, tokens, hidden, assert_close)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("intermediate", [1536, 40])
def test_silu_and_mul(fused, dtype, tokens, intermediate):
    check_silu_and_mul(fused, dtype, tokens, intermediate, assert_close, [-100.0, 100.0, -90.0, 0.0])  # exp's clamp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_on_the_qk_view_of_a_fused_projection(fused, dtype, tokens, head_dim):
    check_rotary(fused, dtype, tokens, head_dim, assert_close)


def test_selection():
    assert isinstance(select_fused_ops("cpu", torch.bfloat16), FusedOps)
    assert select_fused_ops("cpu", torch.float16) is None  # no fp16 kernels: the torch layers
    assert select_fused_ops("cuda", torch.bfloat16).name == "triton"  # kernels/triton/fused_ops.py


@pytest.mark.parametrize("shape", [(1, 49152), (33, 1000), (2, 17), (3, 8)])
def test_argmax_is_torch_argmax(fused, shape):
    logits = randn(*shape, dtype=torch.float32, seed=7)
    assert torch.equal(argmax(logits), reference.argmax(logits))


def test_argmax_ties_and_nans_follow_torch(fused):
    logits = torch.zeros(4, 64)
    logits[1, [5, 40]] = float("nan")  # the first NaN wins
    logits[2, [3, 19, 63]] = 7.0  # ties: the first index
    logits[3, [50, 20]] = float("inf")
    assert argmax(logits).tolist() == reference.argmax(logits).tolist() == [0, 5, 3, 20]
