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

8-bit caches (int8, fp8_e4m3; kernels/kv_cache_layout.py): the write rotates and quantizes each token's
row (`quantize_kv_rows`, the definition every backend's write follows) into the block's slab layout,
and attention dequantizes the gathered context (`read_kv_slabs`, `dequantize_kv_rows`) and attends
as over a float cache: dequantize-then-attend, the answer the kernels that read codes directly are
checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_cache_layout import (
    SCALE_BYTES,
    SCALE_DTYPE,
    hadamard_matrix,
    is_quantized,
    rotate_back,
    slab_offsets,
)

# the largest code of each 8-bit cache: a row's scale is max |x| / this
CODE_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_SCALE_MAX = torch.finfo(SCALE_DTYPE).max


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
    if is_quantized(key_cache.dtype):
        _write_quantized(key, key_cache, blocks, offsets, "key")
        _write_quantized(value, value_cache, blocks, offsets, "value")
        return
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)  # advanced indices first: [T, Hkv, D]
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def _write_quantized(x: torch.Tensor, cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                     kind: str) -> None:
    """x [T, Hkv, D] into an 8-bit cache's slabs (kernels/kv_cache_layout.py) at (blocks, offsets) [T]."""
    num_blocks, num_kv_heads, block_size, row = cache.shape
    head_dim = row - SCALE_BYTES
    codes, scales = quantize_kv_rows(x, cache.dtype)
    slabs = cache.view(torch.uint8).view(num_blocks, num_kv_heads, block_size * row)
    where = slab_offsets(kind, block_size, head_dim).to(cache.device)[offsets]  # [T, D]
    heads = torch.arange(num_kv_heads, device=cache.device)
    slabs[blocks[:, None, None], heads[None, :, None], where[:, None, :]] = codes.view(torch.uint8)
    scale_bytes = scales.view(torch.uint8).view(*scales.shape[:-1], SCALE_BYTES)  # [T, Hkv, 2]
    at = block_size * head_dim + SCALE_BYTES * offsets[:, None] + torch.arange(SCALE_BYTES, device=cache.device)
    slabs[blocks[:, None, None], heads[None, :, None], at[:, None, :]] = scale_bytes


def quantize_kv_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] floats -> (codes [..., D] of the 8-bit `dtype`, scales [..., 1] fp16): one scale per row.

    The row is first rotated, x <- H x (kernels/kv_cache_layout.py: the float64 product rounded to fp32); then
    scale = max |x| / CODE_MAX, rounded to fp16 (and held below fp16's largest); codes = x / scale in fp32,
    int8 rounded half to even and clamped to +-127, fp8 clamped to +-448 and rounded by the conversion;
    a row of zeros gets scale 0 and codes 0."""
    x = (x.double() @ hadamard_matrix(x.shape[-1]).to(x.device)).float()  # H x: exact sums, one rounding
    scale = (x.abs().amax(-1, keepdim=True) / CODE_MAX[dtype]).clamp(max=_SCALE_MAX).to(SCALE_DTYPE)
    divisor = scale.float()
    y = x / torch.where(divisor > 0, divisor, 1.0)
    limit = CODE_MAX[dtype]
    codes = y.round().clamp(-limit, limit) if dtype == torch.int8 else y.clamp(-limit, limit)
    return codes.to(dtype), scale


def dequantize_kv_rows(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """quantize_kv_rows' (codes [..., D], scales [..., 1]) -> [..., D] fp32: code * scale, rotated back."""
    return rotate_back(codes.float() * scales.float())


def read_kv_slabs(slabs: torch.Tensor, kind: str, block_size: int, head_dim: int,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit slabs [..., block_size * (head_dim + 2)] of a "key" or "value" cache -> (codes [..., block_size,
    head_dim] of `dtype`, scales [..., block_size, 1] fp16), token by token."""
    raw = slabs.view(torch.uint8)
    where = slab_offsets(kind, block_size, head_dim).to(slabs.device).flatten()
    codes = raw.index_select(-1, where).view(*raw.shape[:-1], block_size, head_dim).view(dtype)
    scales = raw[..., block_size * head_dim:].contiguous().view(SCALE_DTYPE)
    return codes, scales.view(*raw.shape[:-1], block_size, 1)


def dequantize_kv_cache(cache: torch.Tensor, kind: str) -> torch.Tensor:
    """A whole 8-bit cache [num_blocks, Hkv, block_size, D + 2] of a "key" or "value" cache as fp32 values
    [num_blocks, Hkv, block_size, D], token by token."""
    num_blocks, num_kv_heads, block_size, row = cache.shape
    slabs = cache.view(num_blocks, num_kv_heads, block_size * row)
    return dequantize_kv_rows(*read_kv_slabs(slabs, kind, block_size, row - SCALE_BYTES, cache.dtype))


def gather_context(
    cache: torch.Tensor,  # [num_blocks, Hkv, block_size, row]
    block_tables: torch.Tensor,  # [B, max_blocks]
    context_len: int,
    rows: torch.Tensor | None = None,  # precomputed by _context_rows
    kind: str = "key",  # which of an 8-bit cache's layouts ("key" or "value")
) -> torch.Tensor:
    """The first `context_len` positions of each sequence: [B, Hkv, context_len, D], an 8-bit cache's
    dequantized to fp32.

    One row per (block, kv head) slab through a 2-D index_select, which copies whole
    contiguous rows (several times faster than advanced indexing on the 4-D cache).
    """
    num_blocks, num_kv_heads, block_size, row = cache.shape
    if rows is None:
        rows = _context_rows(block_tables, context_len, num_kv_heads, block_size)
    gathered = cache.view(num_blocks * num_kv_heads, block_size * row).index_select(0, rows)
    if is_quantized(cache.dtype):
        head_dim = row - SCALE_BYTES
        values = dequantize_kv_rows(*read_kv_slabs(gathered, kind, block_size, head_dim, cache.dtype))
        return values.view(len(block_tables), num_kv_heads, -1, head_dim)[:, :, :context_len]
    return gathered.view(len(block_tables), num_kv_heads, -1, row)[:, :, :context_len]


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
    v = gather_context(value_cache, block_tables, plan.decode_len, plan.decode_rows, kind="value")
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    k, v = k.to(q.dtype), v.to(q.dtype)
    if plan.decode_mask is not None and is_quantized(value_cache.dtype):  # past a context: any bytes, NaN too
        v = v.masked_fill(plan.decode_mask.view(num_decodes, 1, -1, 1), 0.0)
    scores = _softcap(torch.matmul(q, k.transpose(-1, -2)).float() * scale, softcap)  # [B, Hkv, G, L]
    if plan.decode_mask is not None:
        scores.masked_fill_(plan.decode_mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(num_decodes, num_heads, head_dim)


def _softcap(scores: torch.Tensor, cap: float | None) -> torch.Tensor:
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _prefill_attention(query, key_cache, value_cache, block_table, seq_len, rows, mask, scale, softcap=None):
    """A chunk of Q query tokens at the end of a context of seq_len tokens."""
    q = query.transpose(0, 1)  # [H, Q, D]
    k = gather_context(key_cache, block_table, seq_len, rows)[0].to(q.dtype)  # [Hkv, L, D]
    v = gather_context(value_cache, block_table, seq_len, rows, kind="value")[0].to(q.dtype)
    if softcap is not None:  # no fused kernel caps scores: plain matmuls, softmax in fp32
        group = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        scores = _softcap(torch.matmul(q, k.transpose(-1, -2)).float() * scale, softcap)  # [H, Q, L]
        if mask is None:
            mask = torch.ones(q.shape[1], seq_len, dtype=torch.bool, device=q.device).tril(seq_len - q.shape[1])
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(q.dtype)
        return torch.matmul(probs, v).transpose(0, 1)  # [Q, H, D]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out.transpose(0, 1)  # [Q, H, D]
