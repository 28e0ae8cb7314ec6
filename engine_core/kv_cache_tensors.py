"""The KV cache's tensors: one (key, value) pair per layer, each [num_blocks, num_kv_heads, block_size, head_dim]
(the layout every attention backend reads, kernels/__init__.py). Made at start-up and again on wake-up; how many
blocks fit a memory budget follows from the same layout (engine_core/startup.py)."""

from __future__ import annotations

import torch

from engine_core.config import ModelArchConfig


def allocate_kv_caches(arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (key, value) tensors for every layer."""
    shape = (num_blocks, arch.num_key_value_heads, block_size, arch.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in range(arch.num_hidden_layers)
    ]


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * element_size
    return per_token * block_size
