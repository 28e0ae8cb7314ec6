"""The checks both fused-op implementations pass (C++: tests/kernels/test_fused_ops.py, Triton:
tests/kernels/test_triton_fused_ops.py): each op, through the torch layer that calls it
(engine_core/models/layers.py), against its reference (kernels/reference/layer_ops.py), with the
in-place contract the model relies on. Each test module passes its own `assert_close` (its
tolerances) and device."""

from __future__ import annotations

import torch

from engine_core.models.layers import RMSNorm, SiluAndMul
from kernels.reference import layer_ops as reference


def randn(*shape, dtype, seed=0, scale=1.0, device="cpu"):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device, dtype)


def check_rms_norm(fused, dtype, tokens, hidden, assert_close, device="cpu", exact_residual=True):
    """Plain and with the residual add, in place in x's and residual's buffers. `exact_residual`:
    the sum is one rounded add in both, so equal (False where the kernel rounds differently:
    then the norm is checked on the sum the kernel made)."""
    fused_norm = RMSNorm(hidden, 1e-5, fused).to(device)
    weight = randn(hidden, dtype=dtype, seed=1, device=device) + 1
    fused_norm.weight.data = weight
    x = randn(tokens, hidden, dtype=dtype, seed=2, device=device)
    residual = randn(tokens, hidden, dtype=dtype, seed=3, scale=4, device=device)
    assert_close(fused_norm(x), reference.rms_norm(x, weight, 1e-5))

    expected, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    x_in, residual_in = x.clone(), residual.clone()
    out, new_residual = fused_norm(x_in, residual_in)
    assert new_residual.data_ptr() == residual_in.data_ptr() and out.data_ptr() == x_in.data_ptr()  # in place
    if exact_residual:
        assert torch.equal(new_residual, expected_residual)
    else:
        assert_close(new_residual, expected_residual)
        expected = reference.rms_norm(new_residual, weight, 1e-5)
    assert_close(out, expected)


def check_silu_and_mul(fused, dtype, tokens, intermediate, assert_close, extremes, device="cpu"):
    """`extremes`: four gate values put in the first row (the tails of the sigmoid)."""
    x = randn(tokens, 2 * intermediate, dtype=dtype, seed=4, scale=3, device=device)
    x[0, :4] = torch.tensor(extremes)
    assert_close(SiluAndMul(fused)(x), reference.silu_and_mul(x))


def check_rotary(fused, dtype, tokens, head_dim, assert_close, device="cpu"):
    """Rotary in place on the q/k view of a fused q/k/v projection (strided rows); v untouched."""
    heads, kv_heads = 9, 3
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=5, device=device)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    angles = randn(tokens, 1, head_dim // 2, dtype=torch.float32, seed=6, scale=3, device=device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected = reference.apply_rotary(qk, cos, sin)
    untouched = qkv[:, (heads + kv_heads) * head_dim:].clone()
    out = fused.apply_rotary(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr()  # in place
    assert_close(out, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], untouched)
