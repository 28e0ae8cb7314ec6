"""Pure-torch paged attention: the reference every kernel is checked against, and
the CPU path. It reads keys and values from the paged cache through block
tables (never from a dense per-request copy kept on the side).

Cache layout: [num_blocks, num_kv_heads, block_size, head_dim] ("head-major", as
vLLM's CPU backend), so gathering one (block, kv head) row at a time yields each
request's context as [Hkv, L, D] with no transposing copy before the matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
) -> None:
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    block_size = key_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)  # advanced indices first: [T, Hkv, D]
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_len: int,
) -> torch.Tensor:
    """The first `context_len` positions of each sequence: [B, Hkv, context_len, D].

    One row per (block, kv head) through a 2-D index_select, which copies whole
    contiguous rows (several times faster than advanced indexing on the 4-D cache).
    """
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    num_seq_blocks = -(-context_len // block_size)
    blocks = block_tables[:, :num_seq_blocks].long()  # [B, nb]
    rows = blocks[:, None, :] * num_kv_heads + torch.arange(num_kv_heads, device=cache.device)[None, :, None]
    gathered = cache.view(num_blocks * num_kv_heads, block_size * head_dim).index_select(0, rows.flatten())
    return gathered.view(len(blocks), num_kv_heads, num_seq_blocks * block_size, head_dim)[:, :, :context_len]


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    out = torch.empty_like(query)
    num_decodes = metadata.num_decodes
    if num_decodes:
        out[:num_decodes] = _decode_attention(query[:num_decodes], key_cache, value_cache, metadata, scale)
    qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    for b in range(num_decodes, metadata.num_reqs):
        start, end = qsl[b], qsl[b + 1]
        out[start:end] = _prefill_attention(
            query[start:end], key_cache, value_cache, metadata.block_tables[b:b + 1], seq_lens[b], scale
        )
    return out


def _decode_attention(query, key_cache, value_cache, metadata, scale):
    """One query token per request, batched: contexts padded to the longest and masked.

    Plain matmuls with the query heads of one kv head grouped (GQA), softmax in fp32.
    """
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    max_len = max(metadata.seq_lens_cpu[:num_decodes])
    block_tables = metadata.block_tables[:num_decodes]
    k = gather_context(key_cache, block_tables, max_len)  # [B, Hkv, L, D]
    v = gather_context(value_cache, block_tables, max_len)
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)).float() * scale  # [B, Hkv, G, L]
    seq_lens = metadata.seq_lens[:num_decodes].to(torch.int64)
    beyond = torch.arange(max_len, device=query.device)[None, :] >= seq_lens[:, None]  # [B, L]
    if bool(beyond.any()):
        scores.masked_fill_(beyond[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v.to(q.dtype)).view(num_decodes, num_heads, head_dim)


def _prefill_attention(query, key_cache, value_cache, block_table, seq_len, scale):
    """A chunk of Q query tokens at the end of a context of seq_len tokens."""
    num_query = query.shape[0]
    k = gather_context(key_cache, block_table, seq_len)[0]  # [Hkv, L, D]
    v = gather_context(value_cache, block_table, seq_len)[0]
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
