"""Pure-torch paged attention and KV-cache write: the reference the C++ and Triton attention
kernels are checked against, and the "torch" backend (any device). It reads keys and values
from the paged cache through block tables (never from a dense per-request copy kept on the side).

Cache layout: [num_blocks, num_kv_heads, block_size, head_dim] ("head-major", as
vLLM's CPU backend), so gathering one (block, kv head) row at a time yields each
request's context as [Hkv, L, D] with no transposing copy before the matmuls.

Everything that depends only on the batch (gather rows, masks, slot splits) is
derived once per step (per sliding window) and kept in `metadata.scratch`, then reused
by every layer.

Per layer, `sliding_window` W lets query position i see keys (i - W, i] only, and
`logit_softcap` c turns scores s (already scaled) into c * tanh(s / c) before the mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


@dataclass
class _Plan:
    """Per-step index tensors shared by all layers of one forward pass."""

    write_blocks: torch.Tensor  # [T'] block of each real (slot >= 0) token
    write_offsets: torch.Tensor  # [T'] offset inside the block
    write_keep: torch.Tensor | None  # [T] bool, None when no slot is -1
    decode_rows: torch.Tensor | None  # [B_dec * Hkv * nb] rows of the (block, head) view
    decode_len: int
    decode_mask: torch.Tensor | None  # [B_dec, 1, 1, L] True beyond a request's context
    prefill_rows: list[torch.Tensor]  # per prefill request: its (block, head) rows
    prefill_masks: list[torch.Tensor | None]  # [Q, L] visibility, None = plain causal


def _context_rows(block_tables: torch.Tensor, context_len: int, num_kv_heads: int, block_size: int) -> torch.Tensor:
    """Rows of cache.view(num_blocks * Hkv, block_size * D) holding [B, Hkv, nb] in that order."""
    num_seq_blocks = -(-context_len // block_size)
    blocks = block_tables[:, :num_seq_blocks].long()  # [B, nb]
    heads = torch.arange(num_kv_heads, device=block_tables.device)
    return (blocks[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()


def _split_slots(slot_mapping: torch.Tensor, block_size: int):
    """(keep mask or None, blocks, offsets) of the real slots (-1 marks padding)."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        keep = None
    else:
        slot_mapping = slot_mapping[keep]
    return keep, slot_mapping // block_size, slot_mapping % block_size


def _plan(metadata: AttentionMetadata, cache: torch.Tensor, window: int | None = None) -> _Plan:
    plan = metadata.scratch.get(("torch_reference", window))
    if plan is not None:
        return plan
    _, num_kv_heads, block_size, _ = cache.shape
    device = cache.device
    write_keep, write_blocks, write_offsets = _split_slots(metadata.slot_mapping, block_size)
    num_decodes = metadata.num_decodes
    decode_rows = decode_mask = None
    decode_len = 0
    if num_decodes:
        decode_len = max(metadata.seq_lens_cpu[:num_decodes])
        decode_rows = _context_rows(metadata.block_tables[:num_decodes], decode_len, num_kv_heads, block_size)
        seq_lens = metadata.seq_lens[:num_decodes].to(torch.int64)
        key_pos = torch.arange(decode_len, device=device)[None, :]
        beyond = key_pos >= seq_lens[:, None]  # [B, L]
        if window is not None:
            beyond |= key_pos <= seq_lens[:, None] - 1 - window
        if bool(beyond.any()):
            decode_mask = beyond[:, None, None, :]
    prefill_rows, prefill_masks = [], []
    qsl = metadata.query_start_loc_cpu
    for b in range(num_decodes, metadata.num_reqs):
        seq_len, num_query = metadata.seq_lens_cpu[b], qsl[b + 1] - qsl[b]
        prefill_rows.append(_context_rows(metadata.block_tables[b:b + 1], seq_len, num_kv_heads, block_size))
        mask = None
        windowed = window is not None and window < seq_len
        if num_query != seq_len or windowed:  # query i sits at position seq_len - Q + i, sees <= it
            q_pos = torch.arange(seq_len - num_query, seq_len, device=device)[:, None]
            key_pos = torch.arange(seq_len, device=device)[None, :]
            mask = (key_pos <= q_pos) & (key_pos > q_pos - window) if windowed else key_pos <= q_pos
        prefill_masks.append(mask)
    plan = _Plan(write_blocks, write_offsets, write_keep, decode_rows, decode_len, decode_mask,
                 prefill_rows, prefill_masks)
    metadata.scratch[("torch_reference", window)] = plan
    return plan


def write_kv_cache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    metadata: AttentionMetadata | None = None,  # reuse the per-step plan when given
) -> None:
    if metadata is not None:
        plan = _plan(metadata, key_cache)
        keep, blocks, offsets = plan.write_keep, plan.write_blocks, plan.write_offsets
    else:
        keep, blocks, offsets = _split_slots(slot_mapping, key_cache.shape[2])
    if keep is not None:
        key, value = key[keep], value[keep]
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)  # advanced indices first: [T, Hkv, D]
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def gather_context(
    cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_len: int,
    rows: torch.Tensor | None = None,  # precomputed by _context_rows
) -> torch.Tensor:
    """The first `context_len` positions of each sequence: [B, Hkv, context_len, D].

    One row per (block, kv head) through a 2-D index_select, which copies whole
    contiguous rows (several times faster than advanced indexing on the 4-D cache).
    """
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    if rows is None:
        rows = _context_rows(block_tables, context_len, num_kv_heads, block_size)
    gathered = cache.view(num_blocks * num_kv_heads, block_size * head_dim).index_select(0, rows)
    return gathered.view(len(block_tables), num_kv_heads, -1, head_dim)[:, :, :context_len]


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [T, H, D]
    plan = _plan(metadata, key_cache, sliding_window)
    num_decodes, cap = metadata.num_decodes, logit_softcap
    if num_decodes == metadata.num_reqs == query.shape[0]:  # decode-only, no padding rows
        return _decode_attention(query, key_cache, value_cache, metadata, plan, scale, cap)
    out = torch.empty_like(query)
    if num_decodes:
        out[:num_decodes] = _decode_attention(query[:num_decodes], key_cache, value_cache, metadata, plan, scale, cap)
    qsl = metadata.query_start_loc_cpu
    for i, b in enumerate(range(num_decodes, metadata.num_reqs)):
        start, end = qsl[b], qsl[b + 1]
        out[start:end] = _prefill_attention(
            query[start:end], key_cache, value_cache, metadata.block_tables[b:b + 1], metadata.seq_lens_cpu[b],
            plan.prefill_rows[i], plan.prefill_masks[i], scale, cap,
        )
    return out


def _decode_attention(query, key_cache, value_cache, metadata, plan: _Plan, scale, softcap=None):
    """One query token per request, batched: contexts padded to the longest and masked.

    Plain matmuls with the query heads of one kv head grouped (GQA), softmax in fp32.
    """
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    block_tables = metadata.block_tables[:num_decodes]
    k = gather_context(key_cache, block_tables, plan.decode_len, plan.decode_rows)  # [B, Hkv, L, D]
    v = gather_context(value_cache, block_tables, plan.decode_len, plan.decode_rows)
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    scores = _softcap(torch.matmul(q, k.to(q.dtype).transpose(-1, -2)).float() * scale, softcap)  # [B, Hkv, G, L]
    if plan.decode_mask is not None:
        scores.masked_fill_(plan.decode_mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v.to(q.dtype)).view(num_decodes, num_heads, head_dim)


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _prefill_attention(query, key_cache, value_cache, block_table, seq_len, rows, mask, scale, softcap=None):
    """A chunk of Q query tokens at the end of a context of seq_len tokens."""
    k = gather_context(key_cache, block_table, seq_len, rows)[0]  # [Hkv, L, D]
    v = gather_context(value_cache, block_table, seq_len, rows)[0]
    q = query.transpose(0, 1)  # [H, Q, D]
    if softcap is not None:  # no fused kernel caps scores: plain matmuls, softmax in fp32
        group = q.shape[0] // k.shape[0]
        k, v = k.to(q.dtype).repeat_interleave(group, 0), v.to(q.dtype).repeat_interleave(group, 0)
        scores = _softcap(torch.matmul(q, k.transpose(-1, -2)).float() * scale, softcap)  # [H, Q, L]
        if mask is None:
            mask = torch.ones(q.shape[1], seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q.shape[1])
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
        return torch.matmul(probs, v).transpose(0, 1)  # [Q, H, D]
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out.transpose(0, 1)  # [Q, H, D]
