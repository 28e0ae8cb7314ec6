"""The KV cache's tensors: one (key, value) pair per layer, each [num_blocks, num_kv_heads, block_size, row] (the
layout every attention backend reads, kernels/kv_cache_layout.py: a row is head_dim values, or an 8-bit cache's
codes and scale). Made at start-up and again on wake-up; how many blocks fit a memory budget follows from the same
layout (engine_core/startup.py)."""

from __future__ import annotations

import torch

from engine_core.config import ModelArchConfig
from kernels import kv_bytes_per_token, kv_cache_shape


def allocate_kv_caches(arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (key, value) tensors for every layer; `dtype` the cache's element type."""
    shape = kv_cache_shape(num_blocks, arch.num_key_value_heads, block_size, arch.head_dim, dtype)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(arch.num_hidden_layers)
    ]


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens (an 8-bit cache's scales included)."""
    per_token = arch.num_hidden_layers * kv_bytes_per_token(arch.num_key_value_heads, arch.head_dim, dtype)
    return per_token * block_size
