"""Paged attention on the CPU through Tandem's C++ kernels (kernels/cpu/csrc/paged_attention.cpp).

Same signatures as its reference, kernels/reference/attention.py. The kernel walks each request's
block table and reads K/V blocks where they lie in the cache, with an online softmax in fp32, so no
layer gathers a request's context into a dense copy. It handles fp32 and bf16 queries over a cache of
their own dtype or an int8 one (codes and a scale per row, kernels/kv_cache_layout.py: the write
quantizes, attention reads the codes; kernels/cpu/csrc/attention_int8.h); a bf16 query over an fp32
cache runs in fp32. Other dtypes (and tensors off the CPU) take the reference path. `batch_invariant`:
a row's output never depends on the rows beside it (the kernel splits no context across threads;
chunks start at the same positions).
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.attention_metadata import AttentionMetadata

DTYPES = (torch.float32, torch.bfloat16)
CACHE_DTYPES = (*DTYPES, torch.int8)


def _supported(x: torch.Tensor, cache: torch.Tensor) -> bool:
    return x.is_cpu and cache.is_cpu and x.dtype in DTYPES and cache.dtype in CACHE_DTYPES


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    metadata: AttentionMetadata | None = None,
) -> None:
    if not _supported(key, key_cache):
        return reference.write_kv_cache(key, value, key_cache, value_cache, slot_mapping, metadata)
    if key_cache.dtype != torch.int8:  # an int8 cache takes the model's rows and quantizes them
        key, value = key.to(key_cache.dtype), value.to(value_cache.dtype)
    torch.ops.tandem.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    batch_invariant: bool = False,  # never split a context across threads: each row's sums in one order
) -> torch.Tensor:  # [T, H, D]
    if not _supported(query, key_cache):
        return reference.paged_attention(query, key_cache, value_cache, metadata, scale, sliding_window, logit_softcap)
    if key_cache.dtype not in (query.dtype, torch.int8):
        if key_cache.dtype != torch.float32:  # an fp32 query over a bf16 cache: the reference rounds as asked
            return reference.paged_attention(query, key_cache, value_cache, metadata, scale, sliding_window,
                                             logit_softcap)
        return paged_attention(query.float(), key_cache, value_cache, metadata, scale, sliding_window, logit_softcap,
                               batch_invariant).to(query.dtype)
    out = torch.empty(query.shape, dtype=query.dtype)
    torch.ops.tandem.paged_attention(
        out, query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
        metadata.query_start_loc, scale, sliding_window or 0, logit_softcap or 0.0, batch_invariant,
    )
    return out
