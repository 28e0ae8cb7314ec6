"""Attention shapes for scripts/bench_kernels.py: random K/V stored both paged (the Triton kernel's
inputs) and dense (SDPA's), and the two kernels run on them (CUDA only)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import AttentionMetadata, select_backend

DECODE_BATCHES = (1, 16, 64)
DECODE_CONTEXTS = (512, 2048, 8192)
# issue 50's grid: every decode shape the bar "time over SDPA" is checked at
BAR_DECODE_BATCHES = (1, 8, 32, 64)
BAR_DECODE_CONTEXTS = (512, 2048, 4096, 8192)
PREFILL_SHAPES = ((1, 512), (1, 2048), (4, 2048), (1, 8192))  # (sequences, tokens each)
HEAD_SHAPES = ((9, 3, 64), (32, 8, 128))  # (query heads, kv heads, head dim)


@dataclass
class AttentionCase:
    """One shape: the paged inputs of the Triton kernel and the dense inputs of SDPA."""

    kind: str  # decode | prefill
    num_seqs: int
    query_len: int  # 1 for decode
    context: int  # tokens of each sequence, this step's included
    heads: tuple[int, int, int]
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, Hkv, block_size, D]
    value_cache: torch.Tensor
    metadata: AttentionMetadata
    dense_q: torch.Tensor  # [B, H, Q, D]
    dense_k: torch.Tensor  # [B, Hkv, L, D]
    dense_v: torch.Tensor

    @property
    def scale(self) -> float:
        return self.heads[2] ** -0.5

    @property
    def kv_bytes(self) -> int:
        """K and V bytes attention must read at least once."""
        return 2 * self.dense_k.numel() * self.dense_k.element_size()


def make_case(kind, num_seqs, context, heads, block_size, dtype, device, seed=0) -> AttentionCase:
    """Random K/V for `num_seqs` sequences of `context` tokens, stored both dense and paged
    (blocks in shuffled order); decode queries the last position, prefill all of them."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    query_len = 1 if kind == "decode" else context
    blocks_per_seq = -(-context // block_size)
    padded = blocks_per_seq * block_size

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    dense_k, dense_v = randn(num_seqs, num_kv_heads, padded, head_dim), randn(num_seqs, num_kv_heads, padded, head_dim)
    block_ids = torch.randperm(num_seqs * blocks_per_seq, generator=gen, device=device) + 1  # 0: null block
    block_tables = block_ids.view(num_seqs, blocks_per_seq).to(torch.int32)
    num_blocks = num_seqs * blocks_per_seq + 1
    caches = []
    for dense in (dense_k, dense_v):
        cache = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
        # [B, Hkv, nb, bs, D] -> one [Hkv, bs, D] block per block-table entry
        blocks = dense.view(num_seqs, num_kv_heads, blocks_per_seq, block_size, head_dim).transpose(1, 2)
        cache[block_ids] = blocks.reshape(-1, num_kv_heads, block_size, head_dim)
        caches.append(cache)
    dense_k, dense_v = dense_k[:, :, :context], dense_v[:, :, :context]

    dense_q = randn(num_seqs, num_heads, query_len, head_dim)
    qsl = [i * query_len for i in range(num_seqs + 1)]
    metadata = AttentionMetadata(
        slot_mapping=torch.full((num_seqs * query_len,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.full((num_seqs,), context, dtype=torch.int32, device=device),
        block_tables=block_tables,
        max_query_len=query_len,
        max_seq_len=context,
        num_decodes=num_seqs if query_len == 1 else 0,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=[context] * num_seqs,
    )
    query = dense_q.transpose(1, 2).reshape(num_seqs * query_len, num_heads, head_dim).contiguous()
    return AttentionCase(kind, num_seqs, query_len, context, heads, query, *caches, metadata,
                         dense_q, dense_k.contiguous(), dense_v.contiguous())


def triton_attention(case: AttentionCase, **launch) -> torch.Tensor:  # [T, H, D]
    """The Triton kernel as the engine launches it; `launch`: num_splits / tuning overrides (the sweep's)."""
    if launch:
        from kernels.triton.paged_attention import paged_attention

        case.metadata.scratch.clear()  # the launch plan is cached per step: a new one for each override
        return paged_attention(case.query, case.key_cache, case.value_cache, case.metadata, case.scale, **launch)
    backend = select_backend(case.query.device.type, "triton")
    return backend.paged_attention(case.query, case.key_cache, case.value_cache, case.metadata, case.scale)


def sdpa_attention(case: AttentionCase) -> torch.Tensor:  # [B, H, Q, D]
    return F.scaled_dot_product_attention(
        case.dense_q, case.dense_k, case.dense_v, is_causal=case.query_len > 1, scale=case.scale, enable_gqa=True,
    )


def max_abs_diff(case: AttentionCase) -> float:
    ours = triton_attention(case).float()
    theirs = sdpa_attention(case).transpose(1, 2).reshape(ours.shape).float()
    return (ours - theirs).abs().max().item()


def bar_decode_cases():
    """(kind, batch, context, heads) of every decode shape issue 50's attention bar names."""
    for heads in HEAD_SHAPES:
        for batch in BAR_DECODE_BATCHES:
            for context in BAR_DECODE_CONTEXTS:
                yield "decode", batch, context, heads


def attention_cases():
    for heads in HEAD_SHAPES:
        for batch in DECODE_BATCHES:
            for context in DECODE_CONTEXTS:
                yield "decode", batch, context, heads
        for batch, context in PREFILL_SHAPES:
            yield "prefill", batch, context, heads
