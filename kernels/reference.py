"""Pure-torch paged attention: the reference every kernel is checked against, and
the CPU path. It reads keys and values from the paged cache through block
tables (never from a dense per-request copy kept on the side).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [B, max_blocks] (or [max_blocks])
    context_len: int,
) -> torch.Tensor:
    """Read the first `context_len` positions of each sequence: [B, context_len, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache[block_table[..., :num_blocks]]  # [B, nb, bs, Hkv, D]
    blocks = blocks.flatten(-4, -3)  # [B, nb*bs, Hkv, D]
    return blocks[..., :context_len, :, :]


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    out = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        out[:num_decodes] = _decode_attention(
            query[:num_decodes], key_cache, value_cache, metadata, scale
        )
    qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for b in range(num_decodes, metadata.num_reqs):
        start, end = qsl[b], qsl[b + 1]
        out[start:end] = _prefill_attention(
            query[start:end], key_cache, value_cache, metadata.block_tables[b], seq_lens[b], scale
        )
    return out


def _decode_attention(query, key_cache, value_cache, metadata, scale):
    """One query token per request, batched: pad contexts to the longest and mask."""
    num_decodes = query.shape[0]
    seq_lens = metadata.seq_lens[:num_decodes]
    max_len = max(metadata.seq_lens_cpu[:num_decodes])
    block_tables = metadata.block_tables[:num_decodes]
    k = gather_context(key_cache, block_tables, max_len).transpose(1, 2)  # [B, Hkv, L, D]
    v = gather_context(value_cache, block_tables, max_len).transpose(1, 2)
    q = query.unsqueeze(2)  # [B, H, 1, D]
    positions = torch.arange(max_len, device=query.device)
    mask = (positions[None, :] < seq_lens[:, None].to(positions.dtype))[:, None, None, :]  # [B,1,1,L]
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(2)  # [B, H, D]


def _prefill_attention(query, key_cache, value_cache, block_table, seq_len, scale):
    """A chunk of Q query tokens at the end of a context of seq_len tokens."""
    num_query = query.shape[0]
    k = gather_context(key_cache, block_table, seq_len).transpose(0, 1)  # [Hkv, L, D]
    v = gather_context(value_cache, block_table, seq_len).transpose(0, 1)
    q = query.transpose(0, 1)  # [H, Q, D]
    if num_query == seq_len:
        mask, causal = None, True
    else:
        # query i sits at position seq_len - Q + i and sees positions <= it
        q_pos = torch.arange(seq_len - num_query, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask, causal = k_pos[None, :] <= q_pos[:, None], False
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=causal, scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out.transpose(0, 1)  # [Q, H, D]
