"""Triton kernels that scatter one step's keys and values into the paged KV cache.

Same contract as their reference, `kernels.reference.write_kv_cache`: token t goes to flat slot
`slot_mapping[t]` = block_id * block_size + offset; slot -1 is padding (CUDA
graph buckets) and is skipped, so padded tokens never touch the cache. An 8-bit cache (int8,
fp8_e4m3) takes each token's codes and fp16 scale per kv head, quantized as
`kernels.reference.quantize_kv_rows` does (after the Hadamard rotation, here an fp32 tl.dot), at their
places in the block's slab (kernels/kv_cache_layout.py). The rotation's fp32 sums (and on a GPU the
division x / scale) may round a code one step from the reference's at a near-tie.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.kv_cache_layout import SCALE_BYTES, hadamard_divisors, hadamard_matrix, is_quantized

CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # kernels/reference/attention.py's
ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + ROUND) - ROUND rounds |y| < 2^22 half to even
E4M3_SUBNORMAL = tl.constexpr(24576.0)  # 1.5 * 2^14: the same to multiples of 2^-9, e4m3's subnormal step


@triton.jit
def _round_to_e4m3(y):
    """y (fp32, |y| <= 448) rounded half to even to e4m3's precision, so that the conversion to fp8 is exact:
    the CPU interpreter's own fp8 conversion drops the carry when a value rounds up to the next power of two
    (120.5 -> 64, not 128), a GPU's hardware rounds as this does."""
    bits = y.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # 3 mantissa bits left, half to even
    normal = bits.to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < 0.015625, (y + E4M3_SUBNORMAL) - E4M3_SUBNORMAL, normal)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr,  # [T, Hkv, D]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, Hkv, block_size, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt, stride_kh, stride_vt, stride_vh,  # last dim of key/value is contiguous
    stride_cb, stride_cs, stride_ch,  # block, slot-in-block, head strides of both caches
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two of NUM_KV_HEADS
    DIM_PAD: tl.constexpr,  # next power of two of HEAD_DIM
):
    """One program per token: copy its [Hkv, D] keys and values to their slot."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size

    heads = tl.arange(0, HEADS_PAD)[:, None]  # [HEADS_PAD, 1]
    dims = tl.arange(0, DIM_PAD)[None, :]  # [1, DIM_PAD]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    dst = block * stride_cb + offset * stride_cs + heads * stride_ch + dims
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_codes(
    x, rotation, cache_ptr, slab, head_slab, offset, block_size, dims, mask, head_mask,
    HEAD_DIM: tl.constexpr, KEY: tl.constexpr, CODE_MAX: tl.constexpr, INT_CODES: tl.constexpr,
):
    """One token's rows x [HEADS_PAD, DIM_PAD] (fp32), rotated (H x), as codes and fp16 scales into their
    slabs: codes at keys' [dim / 4][block_size][4] or values' [block_size / 4][dim][4] places, scales after."""
    x = tl.dot(x, rotation, input_precision="ieee")
    scale = (tl.max(tl.abs(x), axis=1) / CODE_MAX)  # [HEADS_PAD]
    scale = tl.minimum(scale, 65504.0).to(tl.float16)
    divisor = scale.to(tl.float32)
    y = x / tl.where(divisor > 0.0, divisor, 1.0)[:, None]
    y = tl.minimum(tl.maximum(y, -CODE_MAX), CODE_MAX)
    if INT_CODES:
        y = (y + ROUND) - ROUND
    else:
        y = _round_to_e4m3(y)
    if KEY:
        where = (dims // 4) * block_size * 4 + offset * 4 + dims % 4
    else:
        where = (offset // 4) * HEAD_DIM * 4 + dims * 4 + offset % 4
    tl.store(cache_ptr + slab + where, y.to(cache_ptr.dtype.element_ty), mask=mask)
    scale_ptr = (cache_ptr + head_slab + block_size * HEAD_DIM + 2 * offset).to(tl.pointer_type(tl.float16))
    tl.store(scale_ptr, scale, mask=head_mask)


@triton.jit
def _write_kv_codes_kernel(
    key_ptr, value_ptr,  # [T, Hkv, D]
    key_cache_ptr, value_cache_ptr,  # [num_blocks, Hkv, block_size, D + 2] 8-bit slabs
    slot_mapping_ptr,  # [T] int64
    rotation_ptr,  # [DIM_PAD, DIM_PAD] fp32: the Hadamard rotation, zero past D
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch,  # block and head strides of both caches
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    CODE_MAX: tl.constexpr,
    INT_CODES: tl.constexpr,
):
    """One program per token: its [Hkv, D] keys and values as codes and scales."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // block_size
    offset = slot % block_size
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask, other=0.0).to(tl.float32)
    head = tl.arange(0, HEADS_PAD)
    head_slab = block.to(tl.int64) * stride_cb + head * stride_ch  # [HEADS_PAD]
    slab = head_slab[:, None]
    head_mask = head < NUM_KV_HEADS
    rows = tl.arange(0, DIM_PAD)[:, None]
    rotation = tl.load(rotation_ptr + rows * DIM_PAD + dims)
    _write_codes(k, rotation, key_cache_ptr, slab, head_slab, offset, block_size, dims, mask, head_mask, HEAD_DIM,
                 True, CODE_MAX, INT_CODES)
    _write_codes(v, rotation, value_cache_ptr, slab, head_slab, offset, block_size, dims, mask, head_mask,
                 HEAD_DIM, False, CODE_MAX, INT_CODES)


@functools.cache
def rotation(head_dim: int, dim_pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hadamard rotation of an 8-bit cache's rows (kernels/kv_cache_layout.py) as the kernels take it:
    [dim_pad, dim_pad] fp32 (+-1 entries, zero past head_dim) and [dim_pad] fp32 each dim's 1 / block size."""
    matrix = torch.zeros(dim_pad, dim_pad, dtype=torch.float32)
    matrix[:head_dim, :head_dim] = hadamard_matrix(head_dim).float()
    inverse = torch.ones(dim_pad, dtype=torch.float32)
    inverse[:head_dim] = 1.0 / hadamard_divisors(head_dim).float()
    return matrix.to(device), inverse.to(device)


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D], same layout as key_cache
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    metadata=None,  # unused: the kernel needs nothing beyond the slot mapping
) -> None:
    """Write key/value rows into the paged caches in place (no host sync)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    assert key_cache.stride() == value_cache.stride() and key_cache.stride(-1) == 1
    if is_quantized(key_cache.dtype):
        assert key_cache.shape[-1] == head_dim + SCALE_BYTES
        dim_pad = max(16, triton.next_power_of_2(head_dim))
        _write_kv_codes_kernel[(num_tokens,)](
            key, value, key_cache, value_cache, slot_mapping, rotation(head_dim, dim_pad, key.device)[0],
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1),
            key_cache.shape[2],
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            HEADS_PAD=max(16, triton.next_power_of_2(num_kv_heads)), DIM_PAD=dim_pad,  # tl.dot's smallest tile
            CODE_MAX=CODE_MAX[key_cache.dtype], INT_CODES=key_cache.dtype == torch.int8,
        )
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(2), key_cache.stride(1),  # block, slot, head
        key_cache.shape[2],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )
