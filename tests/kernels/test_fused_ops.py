"""The C++ fused layer ops (kernels/fused_ops.py) against the torch layers they replace
(engine_core/models/layers.py, the reference), and the C++ argmax against torch.argmax.

Skipped only where no C++ compiler exists. Tolerances: fp32 atol = rtol = 1e-5 (fused
multiply-adds and another summation order); bf16 rtol = 2^-7 (one bf16 ulp: the torch layers
round some intermediates to bf16 that the fused ops keep in fp32, so a value near a rounding
boundary may land one ulp away) with atol 1e-2 for values near zero.
"""

from __future__ import annotations

import pytest
import torch

from engine_core.models.layers import RMSNorm, SiluAndMul, apply_rotary
from kernels import cpu_extension
from kernels.fused_ops import FusedOps, argmax, select_fused_ops

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


def randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_rms_norm_and_fused_residual_add(fused, dtype, tokens, hidden):
    torch_norm, fused_norm = RMSNorm(hidden, 1e-5), RMSNorm(hidden, 1e-5, fused)
    weight = randn(hidden, dtype=dtype, seed=1) + 1
    torch_norm.weight.data, fused_norm.weight.data = weight, weight
    x, residual = randn(tokens, hidden, dtype=dtype, seed=2), randn(tokens, hidden, dtype=dtype, seed=3, scale=4)
    assert_close(fused_norm(x), torch_norm(x))

    expected, expected_residual = torch_norm(x, residual)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = fused_norm(x_in, residual_in)
    assert new_residual.data_ptr() == residual_in.data_ptr() and out.data_ptr() == x_in.data_ptr()  # in place
    assert torch.equal(new_residual, expected_residual)  # one rounded add, the same in both
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("intermediate", [1536, 40])
def test_silu_and_mul(fused, dtype, tokens, intermediate):
    x = randn(tokens, 2 * intermediate, dtype=dtype, seed=4, scale=3)
    x[0, :4] = torch.tensor([-100.0, 100.0, -90.0, 0.0])  # exp's clamp and both sigmoid branches
    assert_close(SiluAndMul(fused)(x), SiluAndMul()(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("head_dim", [64, 40])
def test_rotary_on_the_qk_view_of_a_fused_projection(fused, dtype, tokens, head_dim):
    heads, kv_heads = 9, 3
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)  # strided rows
    angles = randn(tokens, 1, head_dim // 2, dtype=torch.float32, seed=6, scale=3)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = apply_rotary(qk, cos, sin)
    untouched = qkv[:, (heads + kv_heads) * head_dim:].clone()
    out = fused.apply_rotary(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr()  # in place
    assert_close(out, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], untouched)  # v is left alone


def test_selection():
    assert isinstance(select_fused_ops("cpu", torch.bfloat16), FusedOps)
    assert select_fused_ops("cpu", torch.float16) is None  # no fp16 kernels: the torch layers
    assert select_fused_ops("cuda", torch.bfloat16).name == "triton"  # kernels/triton_fused_ops.py


@pytest.mark.parametrize("shape", [(1, 49152), (33, 1000), (2, 17), (3, 8)])
def test_argmax_is_torch_argmax(fused, shape):
    logits = randn(*shape, dtype=torch.float32, seed=7)
    assert torch.equal(argmax(logits), logits.argmax(dim=-1))


def test_argmax_ties_and_nans_follow_torch(fused):
    logits = torch.zeros(4, 64)
    logits[1, [5, 40]] = float("nan")  # the first NaN wins
    logits[2, [3, 19, 63]] = 7.0  # ties: the first index
    logits[3, [50, 20]] = float("inf")
    assert argmax(logits).tolist() == logits.argmax(dim=-1).tolist() == [0, 5, 3, 20]
