"""The elementwise chain of a decoder layer as Triton kernels, for CUDA models.

The GPU twin of kernels/fused_ops.py (same calling conventions, same in-place contract):
RMSNorm with the residual add folded in, rotary on the q/k view of the fused projection,
and SiLU * mul. In eager torch these are some 20 small kernels per layer; at decode batch
sizes a step is bound by how many kernels it launches (inside a CUDA graph each still costs
a few microseconds), so each becomes one kernel here.

Arithmetic follows the reference (kernels/reference/layer_ops.py, which the torch layers call): fp32
inside, the residual sum rounded to the activations' dtype before the norm reads it, the
normalized row rounded before the weight multiplies it. Rotary keeps its products in fp32
where torch rounds each one, so bf16 results may differ by one ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(
    out_ptr, x_ptr, residual_ptr, weight_ptr,
    stride_out, stride_x, stride_res,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two of hidden
):
    """One program per row: [x + residual ->] residual, then rms_norm(row) * weight -> out."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        total = (x.to(tl.float32) + tl.load(residual_ptr + row * stride_res + cols, mask=mask).to(tl.float32))
        x = total.to(x.dtype)  # the next residual, rounded as torch's add rounds it
        tl.store(residual_ptr + row * stride_res + cols, x, mask=mask)
    h = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / hidden + eps)
    normed = (h * inv_rms).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr,  # x [T, H, D] (last dim contiguous), cos / sin [T, D/2]
    stride_xt, stride_xh, stride_cos, stride_sin,
    num_heads,
    HALF: tl.constexpr,  # D / 2
    HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    """One program per token: rotate every head's two halves in place (rotate_half layout)."""
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HALF)
    cos = tl.load(cos_ptr + token * stride_cos + dims, mask=dims < HALF).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_sin + dims, mask=dims < HALF).to(tl.float32)
    first = x_ptr + token * stride_xt + heads * stride_xh + dims
    x1 = tl.load(first, mask=mask).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, x_ptr,  # out [T, I], x [T, 2I]
    stride_out, stride_x,
    intermediate,
    BLOCK: tl.constexpr,
):
    """One program per (row, BLOCK columns): silu(gate) * up, each rounded as torch rounds it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x with a contiguous last dimension (a row stride is fine)."""
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonFusedOps:
    """The Triton fused ops with the calling conventions of the torch layers they replace."""

    name = "triton"

    @staticmethod
    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: rms_norm(x) * weight. With it: (rms_norm(x + residual) * weight,
        x + residual), computed in place in x's and residual's buffers (both [T, hidden])."""
        x = _rows(x)
        tokens, hidden = x.shape
        out = x if residual is not None else torch.empty_like(x)
        if tokens:
            _rms_norm_kernel[(tokens,)](
                out, x, x if residual is None else residual, weight,
                out.stride(0), x.stride(0), 0 if residual is None else residual.stride(0),
                hidden, eps,
                HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(hidden),
            )
        return out if residual is None else (out, residual)

    @staticmethod
    def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] in place by cos, sin [T, 1, D/2] (rotate_half layout); returns x."""
        assert x.stride(-1) == 1, "rotary rotates rows with a contiguous last dimension in place"
        tokens, heads, head_dim = x.shape
        cos, sin = _rows(cos.squeeze(1)), _rows(sin.squeeze(1))
        if tokens:
            _rotary_kernel[(tokens,)](
                x, cos, sin, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), heads,
                HALF=head_dim // 2, HEADS_PAD=triton.next_power_of_2(heads),
                HALF_PAD=triton.next_power_of_2(head_dim // 2),
            )
        return x

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> silu(x[:, :I]) * x[:, I:] as [T, I]."""
        x = _rows(x)
        tokens, intermediate = x.shape[0], x.shape[1] // 2
        out = x.new_empty(tokens, intermediate)
        block = min(1024, triton.next_power_of_2(intermediate))
        if tokens:
            _silu_and_mul_kernel[(tokens, triton.cdiv(intermediate, block))](
                out, x, out.stride(0), x.stride(0), intermediate, BLOCK=block
            )
        return out
