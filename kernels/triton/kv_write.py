"""Triton kernel that scatters one step's keys and values into the paged KV cache.

Same contract as its reference, `kernels.reference.write_kv_cache`: token t goes to flat slot
`slot_mapping[t]` = block_id * block_size + offset; slot -1 is padding (CUDA
graph buckets) and is skipped, so padded tokens never touch the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
