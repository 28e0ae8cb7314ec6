"""The CPU linears in plain torch: x [N, in] times the weight [out, in] the kernel holds, plus bias.

Each reference takes the float weight, quantizes it exactly as its kernel does (the quantizers are
the formats' own, from kernels/cpu/int8_linear.py and kernels/cpu/int4_linear.py), rounds the activations
where the kernel rounds them, and multiplies in float64. What a kernel may differ by is then its
own rounding: the order of its fp32 sums, fp16/bf16 scales, its output dtype (each test says
how much).
"""

from __future__ import annotations

import torch

from kernels.cpu.int4_linear import dequantize_int4, quantize_int4
from kernels.cpu.int8_blockwise import BLOCK, quantize_activation_blocks, quantize_blockwise
from kernels.cpu.int8_linear import ACTIVATION_GROUP, quantize_int8


def _int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight the int8 kernels hold, in float64: codes times their channel's scale, exactly."""
    q, scale = quantize_int8(weight)
    return q.double() * scale.double()[:, None]


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias in float64: `linear`, `linear_colmajor` and `onednn` (the float kernels)."""
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_bf16_packed`: bf16 activations and weight, their products exact, summed in float64."""
    return float_linear(x.to(torch.bfloat16), weight.to(torch.bfloat16), bias)


def int8_weight_only(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int8` and `int8_gemv`: the float activations times the int8 weight, one scale per output channel."""
    return float_linear(x, _int8_weight(weight), bias)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's activations (the C++ pass `quantize_rows_int8`, kernels/cpu/csrc/int8_rows.cpp): each row of
    x [N, in] -> (int8 codes [N, in], fp32 scale [N]), scale = absmax / 127, rounded half to even."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    return torch.round(xf / scale).to(torch.int8), scale.squeeze(1)


def int8_per_token(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int8_dynamic` and `int8_vnni` (W8A8): each row of x rounded to int8 with its own scale, the int8
    weight per output channel."""
    codes, scale = quantize_rows_int8(x)
    return float_linear(codes.double() * scale.double()[:, None], _int8_weight(weight), bias)


def int8_grouped(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 group: int = ACTIVATION_GROUP) -> torch.Tensor:
    """`int8_grouped` (W8A8 for inputs with outlier channels): x rounded in fp32 per row and group of
    `group` k, as the kernel rounds it, the weight per output channel."""
    rows, in_f = x.shape
    xg = x.float().reshape(rows, in_f // group, group)
    x_scale = (xg.abs().amax(-1, keepdim=True) / 127.0).clamp(min=1e-12)
    xq = torch.round(xg / x_scale).double() * x_scale.double()
    return float_linear(xq.reshape(rows, in_f), _int8_weight(weight), bias)


def int4_weight_only(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int4` and `int4_gemv`: the float activations times the int4 weight (groups of 32 k, a scale
    and a zero each) in fp32 scales; the kernels round those (bf16 / fp16) and `int4` its activations."""
    return float_linear(x, dequantize_int4(*quantize_int4(weight)), bias)


def int8_blockwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`int8_blockwise` (W8A8 in blocks of 32 k, exact on GGUF Q4_0 / Q4_1 / Q8_0 weights): the weight's
    codes, scales and offsets per block (`quantize_blockwise`), x rounded to int8 per row and block of 32
    as the kernel rounds it; the codes' part times the rounded activations, the offsets times the
    blocks' exact sums."""
    codes, scales, offsets = quantize_blockwise(weight)
    xq, x_scale, x_sum = quantize_activation_blocks(x)
    rows, out_f = x.shape[0], weight.shape[0]
    scaled_x = (xq.double() * x_scale.double()).reshape(rows, -1)
    scaled_codes = codes.double().reshape(out_f, -1, BLOCK) * scales.double()[..., None]
    y = scaled_x @ scaled_codes.reshape(out_f, -1).t() + x_sum.double().squeeze(-1) @ offsets.double().t()
    return y if bias is None else y + bias.double()
