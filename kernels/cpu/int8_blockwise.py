"""W8A8 in blocks of 32 k, exact on GGUF block-quantized weights (Q4_0, Q4_1, Q8_0), as llama.cpp
multiplies them on VNNI: the weight's own integer codes times activations rounded to int8 per row
and block of 32 (its q8_1), integer dot products, fp32 scales per block.

The weight is held as int8 codes c with one fp32 scale d and one fp32 offset o per (output, block
of 32 k): w = c * d + o. That holds each format exactly:

- Q4_0: c = q - 8, o = 0
- Q4_1: c = q - 8, o = 8 d + m (llama.cpp's w = q d + m)
- Q8_0: c = q, o = 0 (d = max |w| / 127 of the block)

(for Q4_1 the codes are moved by a whole number so that each block's mean code is within 1/2 of 0,
the offset taking the difference: what the rounded activations multiply is then as small as it
gets), so `int8_blockwise` computes, for x [M, K] rounded per (row, block b) to xq with scale s,

    y[m, n] = sum_b s[m, b] d[n, b] (xq[m, b] . c[n, b]) + sum_b o[n, b] xsum[m, b] (+ bias[n])

with xsum the block's exact fp32 sum of x. llama.cpp's q8_1 keeps the rounded sum (s * sum xq) and
rounds s to fp16, so the whole weight meets the rounded activations; here the offset multiplies the
exact ones and only the centred codes' part of the weight sees their rounding
(docs/cpu-kernels.md#accuracy has the figures).

Codes come back from the dequantized float weight the loader gives: Q4's through
kernels/cpu/int4_linear.py's quantize_int4, Q8_0's as round(w / (max |w| / 127)); each block keeps
whichever grid reproduces it within its dtype's rounding (`int8_blockwise_is_exact`). A float
checkpoint is not exact (its blocks get the Q8_0 grid: --quantization int8 only).

The kernel is kernels/cpu/csrc/int8_blockwise.cpp (AVX512-VNNI); elsewhere `run_int8_blockwise` does
the same arithmetic in torch. Reference: `int8_blockwise` in kernels/reference/linear.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu.int4_linear import dequantize_int4, quantize_int4
from kernels.cpu.int8_linear import int8_vnni_supported
from kernels.cpu.packed_weights import COLUMNS, pack_columns, padded_columns

BLOCK = 32  # k per weight scale and per activation scale: GGUF's Q4_0 / Q4_1 / Q8_0 block
_EXACTNESS_ROWS = 64  # rows of a weight `int8_blockwise_is_exact` checks (a GGUF tensor has one type throughout)
_NO_BIAS = torch.empty(0)


def _q8_grid(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0's grid on blocks w [..., BLOCK] (fp32): codes in -127..127, scale max |w| / 127."""
    scale = w.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale == 0, torch.zeros_like(scale), 1 / scale)
    return (w * inverse).round_().clamp_(-127, 127), scale


def _within_rounding(error: torch.Tensor, tolerance: torch.Tensor) -> torch.Tensor:
    return (error <= tolerance).all(-1)  # per block


def _fit(weight: torch.Tensor):
    """The grids on the weight's blocks and which reproduce each block within the dtype's rounding:
    (q4 codes, scales, offsets; q4_0 codes, scales; q8 codes, scales; w [out, blocks, BLOCK] fp32;
    q4 exact, q4_0 exact, q8 exact)."""
    out_f, in_f = weight.shape
    if in_f % BLOCK:
        raise ValueError(f"in_features {in_f} is not a multiple of the block, {BLOCK}")
    w = weight.detach().float().reshape(out_f, in_f // BLOCK, BLOCK)
    eps = torch.finfo(weight.dtype).eps if weight.dtype.is_floating_point else 0.0
    codes4, scales4, offsets4 = quantize_int4(weight)
    q4 = dequantize_int4(codes4, scales4, offsets4).reshape(w.shape)
    # Q4's scale and offset come from the block's max and min, rounded in the weight's dtype: an error
    # of a few eps of the block's largest magnitude (int4_is_exact's bound; a float block is off by ~6 %)
    q4_exact = _within_rounding((q4 - w).abs(), 2 * eps * w.abs().amax(-1, keepdim=True))
    # Q4_0's grid (no offset) where it holds the block too: quantize_int4 may take Q4_1's for it
    extreme = torch.where(-w.amin(-1, keepdim=True) > w.amax(-1, keepdim=True), w.amin(-1, keepdim=True),
                          w.amax(-1, keepdim=True))
    scale0 = extreme / -8
    inverse0 = torch.where(scale0 == 0, torch.zeros_like(scale0), 1 / scale0)
    codes0 = (w * inverse0).round_().clamp_(-8, 7)
    q40_exact = _within_rounding((codes0 * scale0 - w).abs(), 2 * eps * w.abs().amax(-1, keepdim=True))
    codes8, scale8 = _q8_grid(w)
    # Q8_0's codes are the weight over one scale: each value within its own dtype's rounding (a float
    # block is off by up to half a step, 1/254 of its largest magnitude, in most of its values)
    q8_exact = _within_rounding((codes8 * scale8 - w).abs(),
                                eps * w.abs() + torch.finfo(torch.float32).eps * w.abs().amax(-1, keepdim=True))
    return codes4, scales4, offsets4, codes0, scale0, codes8, scale8, w, q4_exact, q40_exact, q8_exact


def quantize_blockwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 codes [out, in], fp32 scales [out, in / 32], fp32 offsets [out, in / 32])
    with weight ≈ codes * scale + offset block by block: a GGUF Q4_0 / Q4_1 / Q8_0 weight's own codes,
    exactly; a float block's Q8_0 rounding."""
    out_f, in_f = weight.shape
    codes4, scales4, offsets4, codes0, scale0, codes8, scale8, _, q4_exact, q40_exact, _ = _fit(weight)
    # a Q4_0 tensor (every Q4 block holds on Q4_0's grid) takes no offsets, which the kernel then skips;
    # a Q4_1 one keeps Q4_1's grid throughout (Q4_0's would hold some blocks only within the rounding)
    if bool((q40_exact | ~q4_exact).all()):
        codes4, scales4, offsets4 = codes0, scale0.squeeze(-1), torch.zeros_like(scales4)
    else:  # Q4_1: codes centred on their block's mean, the offset taking the rest (see below)
        codes4 = codes4.float().reshape(codes8.shape) - 8
        shift = codes4.mean(-1).round_()  # [out, blocks]
        codes4 -= shift[..., None]
        offsets4 = offsets4 + shift * scales4
    use4 = q4_exact[..., None]  # Q4 where it holds the block exactly (fewer levels: finer activations' error)
    codes = torch.where(use4, codes4, codes8).to(torch.int8).reshape(out_f, in_f)
    scales = torch.where(q4_exact, scales4, scale8.squeeze(-1))
    offsets = torch.where(q4_exact, offsets4, torch.zeros_like(offsets4))
    return codes, scales, offsets


def dequantize_blockwise(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [out, in] that `quantize_blockwise`'s (codes, scales, offsets) stand for."""
    out_f, in_f = codes.shape
    c = codes.float().reshape(out_f, in_f // BLOCK, BLOCK)
    return (c * scales[..., None] + offsets[..., None]).reshape(out_f, in_f)


def int8_blockwise_is_exact(weight: torch.Tensor) -> bool:
    """Whether `quantize_blockwise` reproduces `weight` within the rounding of its own dtype: true for
    weights dequantized from a Q4_0 / Q4_1 / Q8_0 GGUF, false for a float checkpoint."""
    if weight.ndim != 2 or weight.shape[1] % BLOCK or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    rows = weight.detach()[:: max(1, weight.shape[0] // _EXACTNESS_ROWS)]  # evenly spaced rows
    *_, q4_exact, _, q8_exact = _fit(rows)
    return bool((q4_exact | q8_exact).all())


def int8_blockwise_fits(weight: torch.Tensor) -> bool:
    """Whether the C++ kernel can hold this weight: float, whole blocks of k, a VNNI build."""
    return (weight.dtype in (torch.float32, torch.bfloat16) and weight.ndim == 2 and weight.shape[1] % BLOCK == 0
            and int8_vnni_supported())


# ---- the kernel: prepare(weight, bias) -> state, run(state, x [N, in]) -> [N, out] ----

def prepare_int8_blockwise(weight: torch.Tensor, bias: torch.Tensor | None):
    """The weight as the C++ kernel streams it, per 16 output columns and block of 32 k:
    [ceil(N / 16), K / 32, 8 + 1 + has_offsets, 64] bytes: 8 chunks of codes + 128 (unsigned bytes,
    vpdpbusd's order: chunk t, column j, k = 4t..4t+3), the 16 columns' fp32 scales, then their fp32
    offsets where any is nonzero (Q4_1; Q4_0 and Q8_0 have none). Where the kernel is not built, the
    float operands of the same arithmetic."""
    codes, scales, offsets = quantize_blockwise(weight)
    b = _NO_BIAS if bias is None else bias.detach().float().contiguous()
    has_offsets = bool(offsets.any())
    if not int8_blockwise_fits(weight):  # torch fallback: the dequantized codes and the offsets
        c = codes.float().reshape(*scales.shape, BLOCK)
        return None, (c * scales[..., None]).reshape(codes.shape), offsets if has_offsets else None, b, weight.dtype
    out_f, in_f = codes.shape
    blocks, pad = in_f // BLOCK, padded_columns(out_f) - out_f
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    chunks = pack_columns(unsigned, 4).reshape(-1, blocks, BLOCK // 4 * COLUMNS * 4)  # [col block, b, 512]
    per_block = [scales] + ([offsets] if has_offsets else [])
    floats = torch.stack([F.pad(t, (0, 0, 0, pad)) for t in per_block], dim=-1)  # [N padded, b, 1 or 2]
    floats = floats.reshape(-1, COLUMNS, blocks, len(per_block)).permute(0, 2, 3, 1).contiguous()
    float_bytes = floats.view(torch.uint8).reshape(-1, blocks, len(per_block) * COLUMNS * 4)
    packed = torch.cat([chunks, float_bytes], dim=-1).reshape(-1, blocks, BLOCK // 4 + len(per_block), 64)
    return packed.contiguous(), None, None, b, weight.dtype, out_f


def run_int8_blockwise(state, x: torch.Tensor) -> torch.Tensor:
    """W8A8 per block of 32 k (see the module's docstring); outputs in the weight's dtype."""
    if state[0] is None:
        return _run_torch(state, x)
    packed, _, _, b, dtype, out_f = state
    y = torch.empty((x.shape[0], out_f), dtype=dtype)
    torch.ops.tandem.int8_blockwise_gemm(y, x if x.stride(-1) == 1 else x.contiguous(), packed, b)
    return y


def quantize_activation_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 codes [M, K/32, 32], fp32 scale [M, K/32, 1], fp32 sum [M, K/32, 1]): each row's
    blocks of 32 rounded to int8 with scale absmax / 127 (half to even), and their exact sums."""
    xb = x.float().reshape(x.shape[0], -1, BLOCK)
    scale = (xb.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    return torch.round(xb / scale), scale, xb.sum(-1, keepdim=True)


def _run_torch(state, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic where it is not built: the rounded activations times the codes' part of
    the weight in fp32, plus the offsets times the exact block sums."""
    _, scaled_codes, offsets, b, dtype = state
    codes, scale, sums = quantize_activation_blocks(x)
    y = (codes * scale).reshape(x.shape[0], -1) @ scaled_codes.t()
    if offsets is not None:
        y += sums.squeeze(-1) @ offsets.t()
    if b.numel():
        y += b
    return y.to(dtype)
