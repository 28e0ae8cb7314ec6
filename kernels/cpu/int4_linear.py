"""Int4 weights for CPU linear layers: groups of 32 inputs, one scale and one zero per group.

The layout is GGUF's own 4-bit block (32 weights, a scale and a zero). Two kernels multiply by it:
torch's `_weight_int4pack_mm_for_cpu` (`int4`: w = (q - 8) * scale + zero per group; bf16
activations: its fp32 path is exact but far slower, docs/cpu-kernels.md#int4_gemv), and for a few rows Tandem's C++ GEMV
(`int4_gemv`, kernels/cpu/csrc/int4_gemv.cpp, where the CPU has AVX512-VNNI: 5 bits a weight read
at close to memory speed, activations rounded to 16 bits per row as int8_gemv's are, fp16 scales
and mins). Each group keeps whichever of two grids reconstructs it better:

- asymmetric, GGUF Q4_1: scale = (max - min) / 15, zero = min (llama.cpp's Q4_1 quantizer)
- symmetric, GGUF Q4_0: scale = -v / 8 where v is the group's value of largest magnitude

A weight dequantized from a Q4_0 or Q4_1 GGUF tensor therefore gets the file's own codes
back (llama.cpp's quantizers put code 0 on the group's extreme, and Q4_1 code 15 on the other
one): loading such a file as int4 reproduces its weights up to the bf16 rounding of the
scales, the same rounding as running the dequantized model in bf16. Quantizing a float
checkpoint this way is lossy (~8-10 % relative error per weight): that is the user's
`--quantization int4`, never picked silently.

Reference (both kernels): `int4_weight_only` in kernels/reference/linear.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu.int8_linear import int8_vnni_supported
from kernels.cpu.packed_weights import COLUMNS, padded_columns

GROUP_SIZE = 32  # GGUF's block; torch's kernel takes 32, 64, 128 or 256
_N_MULTIPLE = 16  # torch's CPU int4 packing wants out_features divisible by 16


def int4_supported(out_features: int, in_features: int, group_size: int = GROUP_SIZE) -> bool:
    """Whether torch's CPU int4 kernel takes a weight of this shape."""
    return out_features % _N_MULTIPLE == 0 and in_features % group_size == 0


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """weight [out, in] -> (codes uint8 [out, in] in 0..15, scales [out, in/g], zeros [out, in/g]),
    fp32 scales and zeros, with weight ≈ (codes - 8) * scale + zero group by group."""
    out_f, in_f = weight.shape
    if in_f % group_size:
        raise ValueError(f"in_features {in_f} is not a multiple of the int4 group size {group_size}")
    w = weight.detach().float().reshape(out_f, in_f // group_size, group_size)  # [out, groups, g]

    # asymmetric (Q4_1): code 0 at the minimum, 15 at the maximum
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)  # [out, groups, 1]
    scale_a = (high - low) / 15
    codes_a = _codes(w - low, scale_a, 0)
    zero_a = low + 8 * scale_a
    # symmetric (Q4_0): code 0 at the value of largest magnitude, zero fixed at 0
    scale_s = torch.where(-low > high, low, high) / -8
    codes_s = _codes(w, scale_s, 8)

    use_a = _squared_error(codes_a, scale_a, zero_a, w) <= _squared_error(codes_s, scale_s, 0.0, w)
    # whole codes blend exactly, and faster than a broadcast torch.where
    codes = codes_s.add_(use_a * (codes_a - codes_s))
    scales = torch.where(use_a, scale_a, scale_s).squeeze(-1)
    zeros = torch.where(use_a, zero_a, torch.zeros_like(zero_a)).squeeze(-1)
    return codes.to(torch.uint8).reshape(out_f, in_f), scales, zeros


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] that (codes, scales, zeros) from `quantize_int4` stand for."""
    out_f, in_f = codes.shape
    groups = scales.shape[1]
    q = codes.float().reshape(out_f, groups, in_f // groups) - 8
    return (q * scales[..., None] + zeros[..., None]).reshape(out_f, in_f)


def _codes(x: torch.Tensor, scale: torch.Tensor, offset: int) -> torch.Tensor:
    """round(x / scale + offset) clamped to 0..15; a constant group (scale 0) gets `offset`."""
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    return (x * inverse).add_(offset).round_().clamp_(0, 15)


def _squared_error(codes, scale, zero, w) -> torch.Tensor:  # [out, groups, 1]
    return ((codes - 8).mul_(scale).add_(zero).sub_(w)).square_().sum(-1, keepdim=True)


# ---- the kernel: prepare(weight, bias) -> state, run(state, x [N, in]) -> [N, out] ----

def prepare_int4(weight: torch.Tensor, bias: torch.Tensor | None, group_size: int = GROUP_SIZE):
    """Quantize and pack a float weight [out, in] for `run_int4`; keeps the caller's dtype for outputs."""
    codes, scales, zeros = quantize_int4(weight, group_size)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)  # [out, in/2] uint8
    # [groups, out, 2] as the kernel reads them
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, group_size, scales_and_zeros, bias, weight.dtype


def run_int4(state, x: torch.Tensor) -> torch.Tensor:
    packed, group_size, scales_and_zeros, bias, dtype = state
    y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, group_size, scales_and_zeros)
    y = y.to(dtype)
    return y if bias is None else y + bias


def int4_gemv_supported(weight: torch.Tensor) -> bool:
    """Whether `int4_gemv` can hold this weight: Tandem's kernels built for AVX512-VNNI, float
    weights, whole groups, and each group's scale and min within fp16's range (the build
    requirement is int8_vnni's)."""
    if weight.dtype not in (torch.float32, torch.bfloat16) or weight.shape[1] % GROUP_SIZE:
        return False
    if not int8_vnni_supported():
        return False
    largest = weight.detach().abs().amax().item()  # a group's scale and min are at most ~this
    return largest <= torch.finfo(torch.float16).max / 2


def prepare_int4_gemv(weight: torch.Tensor, bias: torch.Tensor | None):
    """Quantize and pack a float weight [out, in] for `run_int4_gemv`: [ceil(out/16), in/32, 320]
    uint8, per block of 16 columns and group of 32 k the codes two to a byte (four 8-k chunks of
    64 bytes: column c's byte j of chunk t holds k = 8t + j low, 8t + 4 + j high), then the 16
    columns' scales and their mins (w = q * scale + min) in fp16."""
    codes, scales, zeros = quantize_int4(weight)
    out_f, in_f = codes.shape
    pad, groups = padded_columns(out_f) - out_f, in_f // GROUP_SIZE
    codes = F.pad(codes, (0, 0, 0, pad)).reshape(-1, COLUMNS, groups, 4, 2, 4)  # [block, col, g, t, half, j]
    nibbles = codes[..., 0, :] | (codes[..., 1, :] << 4)  # [block, col, g, t, j]
    chunks = nibbles.permute(0, 2, 3, 1, 4).reshape(-1, groups, 4 * COLUMNS * 4)  # [block, g, 256]
    mins = zeros - 8 * scales  # (q - 8) * scale + zero = q * scale + min
    pairs = F.pad(torch.stack([scales, mins], dim=-1), (0, 0, 0, 0, 0, pad))  # [out, g, 2]
    pairs = pairs.reshape(-1, COLUMNS, groups, 2).permute(0, 2, 3, 1).to(torch.float16)  # [block, g, 2, 16]
    scale_bytes = pairs.contiguous().view(torch.uint8).reshape(-1, groups, 4 * COLUMNS)  # [block, g, 64]
    return torch.cat([chunks, scale_bytes], dim=-1).contiguous(), bias, out_f


def run_int4_gemv(state, x: torch.Tensor) -> torch.Tensor:
    """Weight-only int4 for a few rows (decode) through the C++ GEMV; outputs in x's dtype."""
    packed, bias, out_f = state
    y = torch.empty((x.shape[0], out_f), dtype=x.dtype)
    torch.ops.tandem.int4_gemv(y, x if x.stride(-1) == 1 else x.contiguous(), packed)
    return y if bias is None else y + bias
