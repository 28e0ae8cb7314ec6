"""The Triton fused layer ops (kernels/triton_fused_ops.py) against the torch layers they
replace (engine_core/models/layers.py, the reference).

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

from engine_core.models.layers import RMSNorm, SiluAndMul, apply_rotary
from kernels.triton_fused_ops import TritonFusedOps

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


def randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [576, 40])  # SmolLM2's hidden size, and one short of a power of two
def test_rms_norm_and_fused_residual_add(dtype, tokens, hidden):
    torch_norm, fused_norm = RMSNorm(hidden, 1e-5).to(DEVICE), RMSNorm(hidden, 1e-5, fused).to(DEVICE)
    weight = randn(hidden, dtype=dtype, seed=1) + 1
    torch_norm.weight.data, fused_norm.weight.data = weight, weight
    x, residual = randn(tokens, hidden, dtype=dtype, seed=2), randn(tokens, hidden, dtype=dtype, seed=3, scale=4)
    assert_close(fused_norm(x), torch_norm(x))

    expected, expected_residual = torch_norm(x, residual)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = fused_norm(x_in, residual_in)
    assert new_residual.data_ptr() == residual_in.data_ptr() and out.data_ptr() == x_in.data_ptr()  # in place
    if INTERPRETED and dtype == torch.bfloat16:  # a truncated add: norm the sum the kernel made
        assert_close(new_residual, expected_residual)
        expected = torch_norm(new_residual)
    else:
        assert torch.equal(new_residual, expected_residual)  # one rounded add, the same in both
    assert_close(out, expected)


def test_rms_norm_reads_strided_rows():
    x = randn(3, 2, 64, dtype=torch.float32, seed=8)[:, 0]  # rows 128 apart
    weight = randn(64, dtype=torch.float32, seed=9)
    assert_close(fused.rms_norm(x, weight, 1e-6), torch.nn.functional.rms_norm(x, (64,), weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("intermediate", [1536, 40])  # 1536: more than one 1024-column block
def test_silu_and_mul(dtype, tokens, intermediate):
    x = randn(tokens, 2 * intermediate, dtype=dtype, seed=4, scale=3)
    x[0, :4] = torch.tensor([-60.0, 60.0, -50.0, 0.0])  # far into both tails of the sigmoid
    assert_close(SiluAndMul(fused)(x), SiluAndMul()(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: half a head is not a power of two
def test_rotary_on_the_qk_view_of_a_fused_projection(dtype, tokens, head_dim):
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


def test_empty_batches_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert fused.rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert fused.silu_and_mul(torch.empty(0, 80, device=DEVICE)).shape == (0, 40)
