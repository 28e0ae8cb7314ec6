"""Random flattened ragged batches over a paged KV cache, for kernel tests.

`make_batch` builds decodes first, then prefill chunks with cached context, over a
paged cache of noise with shuffled block tables; `quantized` turns such a batch's cache into an
8-bit one (kernels/kv_cache_layout.py); `dense_attention` is the from-scratch float64 answer
that needs no paging at all. `DEVICE` is where kernel tests run: the GPU
when there is one, else the CPU (Triton in its interpreter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

from kernels import reference
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_cache_layout import kv_cache_shape

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D], T includes pad_tokens padding rows at the end
    key: torch.Tensor  # [T, Hkv, D] this step's keys (already in the cache)
    value: torch.Tensor  # [T, Hkv, D]
    key_cache: torch.Tensor  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor
    metadata: AttentionMetadata
    dense_keys: list[torch.Tensor]  # per request [seq_len, Hkv, D], on the CPU
    dense_values: list[torch.Tensor]


def make_batch(
    query_lens: list[int],  # decodes (1) first, then prefill chunks
    seq_lens: list[int],  # each >= its query length
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    pad_tokens: int = 0,
    spare_blocks: int = 3,
    device: torch.device | str = "cpu",
) -> PagedBatch:
    """Random batch whose whole context already sits in a paged cache of noise.

    Blocks are handed out in a random order (block 0 stays the null block that
    pads block-table rows) and unused cache blocks hold random values, so a
    kernel reading the wrong block or position gives a wrong answer. Built on the CPU
    (same values everywhere for a seed), then moved to `device`.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + spare_blocks
    key_cache = randn(num_blocks, num_kv_heads, block_size, head_dim)
    value_cache = randn(num_blocks, num_kv_heads, block_size, head_dim)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_req) + 1  # one extra padded column
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)

    dense_keys, dense_values, slots = [], [], []
    for b, (q_len, seq_len) in enumerate(zip(query_lens, seq_lens)):
        blocks = [free.pop() for _ in range(blocks_per_req[b])]
        block_tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        pos = torch.arange(seq_len)
        slot = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        k, v = randn(seq_len, num_kv_heads, head_dim), randn(seq_len, num_kv_heads, head_dim)
        key_cache[slot // block_size, :, slot % block_size] = k
        value_cache[slot // block_size, :, slot % block_size] = v
        dense_keys.append(k)
        dense_values.append(v)
        slots.append(slot[seq_len - q_len :])

    slots.append(torch.full((pad_tokens,), -1, dtype=torch.int64))
    qsl = [0]
    for q_len in query_lens:
        qsl.append(qsl[-1] + q_len)
    num_tokens = qsl[-1] + pad_tokens
    pad_kv = randn(pad_tokens, num_kv_heads, head_dim)
    step = list(zip(seq_lens, query_lens))
    key = torch.cat([k[s - q :] for k, (s, q) in zip(dense_keys, step)] + [pad_kv])
    value = torch.cat([v[s - q :] for v, (s, q) in zip(dense_values, step)] + [pad_kv])
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device=device, dtype=torch.int64),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=_leading_decodes(query_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=list(seq_lens),
    )
    query = randn(num_tokens, num_heads, head_dim)
    on_device = [t.to(device) for t in (query, key, value, key_cache, value_cache)]
    return PagedBatch(*on_device, metadata, dense_keys, dense_values)


def quantized(batch: PagedBatch, dtype: torch.dtype = torch.int8, seed: int = 0) -> PagedBatch:
    """The same batch over an 8-bit cache: random bytes everywhere (scales that are NaN or inf among them, where
    no token was written), then every request's context written by the reference; its dense keys and values
    become the dequantized ones, so `dense_attention` gives dequantize-then-attend from scratch."""
    num_blocks, num_kv_heads, block_size, head_dim = batch.key_cache.shape
    gen = torch.Generator().manual_seed(seed)
    shape = kv_cache_shape(num_blocks, num_kv_heads, block_size, head_dim, dtype)
    key_cache, value_cache = (torch.randint(-128, 128, shape, dtype=torch.int8, generator=gen).view(dtype)
                              for _ in range(2))
    md = batch.metadata
    dense_keys, dense_values = [], []
    for b, (k, v) in enumerate(zip(batch.dense_keys, batch.dense_values)):
        pos = torch.arange(len(k))
        slots = md.block_tables[b].cpu().long()[pos // block_size] * block_size + pos % block_size
        reference.write_kv_cache(k, v, key_cache, value_cache, slots)
        dense_keys.append(reference.dequantize_kv_rows(*reference.quantize_kv_rows(k, dtype)))
        dense_values.append(reference.dequantize_kv_rows(*reference.quantize_kv_rows(v, dtype)))
    device = batch.query.device
    return PagedBatch(batch.query, batch.key, batch.value, key_cache.to(device), value_cache.to(device), md,
                      dense_keys, dense_values)


def _leading_decodes(query_lens: list[int]) -> int:
    n = 0
    while n < len(query_lens) and query_lens[n] == 1:
        n += 1
    return n


@st.composite
def ragged_batches(draw, max_decodes=3, max_prefills=2, max_context=70, max_chunk=20):
    """(query_lens, seq_lens): decodes first, then prefill chunks with cached context."""
    num_decodes = draw(st.integers(0, max_decodes))
    num_prefills = draw(st.integers(0 if num_decodes else 1, max_prefills))
    query_lens, seq_lens = [], []
    for _ in range(num_decodes):
        query_lens.append(1)
        seq_lens.append(draw(st.integers(1, max_context)))
    for _ in range(num_prefills):
        chunk = draw(st.integers(2, max_chunk))  # a 1-token chunk would be a decode
        query_lens.append(chunk)
        seq_lens.append(chunk + draw(st.integers(0, max_context - chunk)))
    return query_lens, seq_lens


def dense_attention(
    batch: PagedBatch, scale: float, window: int | None = None, softcap: float | None = None
) -> torch.Tensor:
    """Per-request attention in float64 from the dense K/V, no paging involved: [T, H, D].
    `window`: query i sees keys (i - window, i]; `softcap`: scores -> c * tanh(scores / c)."""
    md = batch.metadata
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    group = batch.query.shape[1] // batch.dense_keys[0].shape[1]
    for b in range(md.num_reqs):
        start, end = md.query_start_loc_cpu[b], md.query_start_loc_cpu[b + 1]
        seq_len = md.seq_lens_cpu[b]
        q = batch.query[start:end].cpu().double().transpose(0, 1)  # [H, Q, D]
        k = batch.dense_keys[b].double().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
        v = batch.dense_values[b].double().repeat_interleave(group, 1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * scale  # [H, Q, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        hidden = (key_pos > q_pos) | (key_pos <= q_pos - (window or seq_len + 1))
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def cache_by_slot(cache: torch.Tensor) -> torch.Tensor:
    """A [num_blocks * block_size, Hkv, D] copy of a paged cache, indexable by slot."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    return cache.transpose(1, 2).reshape(num_blocks * block_size, num_kv_heads, head_dim)
