"""Triton KV-write and paged-attention kernels against the torch reference.

On DEVICE: the GPU when there is one. On a machine without CUDA these run in Triton's
CPU interpreter (tests/conftest.py sets TRITON_INTERPRET=1), which costs tens of
milliseconds per program: shapes stay tiny (few heads, short contexts, small head dims)
apart from the head-dim cases. Model-sized shapes and graph capture run on CUDA only.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from kernels import reference, select_backend
from kernels.triton.paged_attention import choose_num_splits, decode_tuning
from tests.kernels.paged_batch import DEVICE, cache_by_slot, make_batch, ragged_batches

TRITON = select_backend(DEVICE.type, "triton")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# No shrinking: each interpreted example costs about a second, and the examples are tiny anyway.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)
# atol = rtol per dtype: bf16 and fp16 outputs differ from the reference by a couple of ulps
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# (num_kv_heads, queries per kv head): GQA ratios 1, 3 and 8
HEADS = [(2, 1), (1, 3), (1, 8), (2, 3)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_both(batch, scale, num_splits=None):
    """(triton, reference) outputs over the batch's real tokens, padding rows dropped."""
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale)
    out = TRITON.paged_attention(*args, num_splits=num_splits)
    expected = reference.paged_attention(*args)
    num_real = batch.metadata.query_start_loc_cpu[-1]
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    return out[:num_real], expected[:num_real]


def assert_matches(out, expected):
    tol = TOL[out.dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def build(shape, heads, head_dim, block_size, dtype, seed, pad_tokens=0):
    (query_lens, seq_lens), (num_kv_heads, group) = shape, heads
    return make_batch(
        query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype,
        seed, pad_tokens, device=DEVICE,
    )


# --- KV write


@settings(max_examples=12, deadline=None, phases=NO_SHRINK)
@given(
    shape=ragged_batches(max_decodes=4),
    num_kv_heads=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from([8, 16, 24]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from(DTYPES),
    pad_tokens=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_write_kv_cache_matches_reference(
    shape, num_kv_heads, head_dim, block_size, dtype, pad_tokens, seed
):
    batch = build(shape, (num_kv_heads, 1), head_dim, block_size, dtype, seed, pad_tokens)
    slots = batch.metadata.slot_mapping
    caches = [torch.zeros_like(batch.key_cache) for _ in range(4)]
    TRITON.write_kv_cache(batch.key, batch.value, caches[0], caches[1], slots)
    reference.write_kv_cache(batch.key, batch.value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_write_kv_cache_skips_padding_slots_and_keeps_the_rest():
    batch = make_batch([1, 1, 6], [7, 20, 6], 2, 2, 16, 16, pad_tokens=4, seed=5, device=DEVICE)
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    key = torch.randn_like(batch.key)  # new values, so written slots visibly change
    value = torch.randn_like(batch.value)
    slots = batch.metadata.slot_mapping
    TRITON.write_kv_cache(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = cache_by_slot(key_cache), cache_by_slot(value_cache)
    real = slots >= 0
    assert int(real.sum()) == 8
    assert torch.equal(flat_k[slots[real]], key[real])
    assert torch.equal(flat_v[slots[real]], value[real])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[real]] = False
    assert torch.equal(flat_k[untouched], cache_by_slot(batch.key_cache)[untouched])
    assert torch.equal(flat_v[untouched], cache_by_slot(batch.value_cache)[untouched])


def test_write_kv_cache_from_strided_qkv_views_casts_to_cache_dtype():
    # fp16 cache: the CPU interpreter rounds fp32 -> fp16 like torch, but truncates fp32 -> bf16
    batch = make_batch([3], [3], 2, 2, 16, 16, torch.float16, seed=6, device=DEVICE)
    qkv = torch.randn(3, 3, 2, 16, device=DEVICE)  # fp32; key and value are non-contiguous views
    key, value = qkv[:, 1], qkv[:, 2]
    key_cache, value_cache = batch.key_cache.clone(), batch.value_cache.clone()
    TRITON.write_kv_cache(key, value, key_cache, value_cache, batch.metadata.slot_mapping)
    slots = batch.metadata.slot_mapping
    assert torch.equal(cache_by_slot(key_cache)[slots], key.half())
    assert torch.equal(cache_by_slot(value_cache)[slots], value.half())


# --- paged attention


@settings(max_examples=24, deadline=None, phases=NO_SHRINK)
@given(
    shape=ragged_batches(max_decodes=5),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([16, 32]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from(DTYPES),
    pad_tokens=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_matches_reference(
    shape, heads, head_dim, block_size, dtype, pad_tokens, seed
):
    batch = build(shape, heads, head_dim, block_size, dtype, seed, pad_tokens)
    assert_matches(*run_both(batch, head_dim**-0.5))


@settings(max_examples=10, deadline=None, phases=NO_SHRINK)
@given(
    shape=ragged_batches(max_decodes=3, max_prefills=1, max_context=150, max_chunk=12),
    heads=st.sampled_from(HEADS),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from(DTYPES),
    num_splits=st.sampled_from([2, 4, 8]),
    seed=st.integers(0, 2**16),
)
def test_split_context_matches_reference(shape, heads, block_size, dtype, num_splits, seed):
    """Forced split context, including splits left with no tiles for short contexts."""
    batch = build(shape, heads, 16, block_size, dtype, seed, pad_tokens=1)
    assert_matches(*run_both(batch, 0.25, num_splits=num_splits))


@pytest.mark.parametrize(
    "query_lens, seq_lens",
    [
        ([1] * 9 + [3, 70], [5, 17, 33, 1, 2, 48, 16, 32, 9, 40, 70]),  # many decodes, long chunk
        ([70, 2], [100, 2]),  # chunk spanning two query blocks behind cached context
    ],
)
@pytest.mark.parametrize("heads", [(1, 1), (1, 8)])
def test_paged_attention_query_block_mapping(query_lens, seq_lens, heads):
    batch = build((query_lens, seq_lens), heads, 16, 16, torch.float32, seed=7, pad_tokens=3)
    assert_matches(*run_both(batch, 0.25))


@pytest.mark.parametrize(
    "head_dim, dtype", [(64, torch.bfloat16), (128, torch.float16), (24, torch.float32)]
)
def test_paged_attention_head_dims(head_dim, dtype):
    batch = build(([1, 1, 9], [40, 3, 25]), (2, 3), head_dim, 16, dtype, seed=8)
    assert_matches(*run_both(batch, head_dim**-0.5))
    assert_matches(*run_both(batch, head_dim**-0.5, num_splits=2))


def test_small_long_decode_batch_splits_on_its_own():
    batch = build(([1, 1], [600, 530]), (1, 3), 16, 32, torch.float32, seed=9)
    assert choose_num_splits(batch.metadata, num_kv_heads=1, num_sms=4) == 4  # 2 programs; 600 positions
    assert_matches(*run_both(batch, 0.25))


def test_choose_num_splits_fills_the_gpu():
    """Enough programs for every SM, a power of two, never shorter than min_split_tokens per split."""
    decode = make_batch([1, 1], [4096, 10], 8, 8, 8, 16).metadata  # 2 requests x 8 kv heads
    tuning = decode_tuning(64)
    for num_sms in (16, 78, 114, 132):
        for num_reqs in (1, 2, 8, 32, 64, 256):
            for max_seq_len in (100, 512, 4096, 8192):
                md = dataclasses.replace(decode, seq_lens_cpu=[1] * num_reqs, max_seq_len=max_seq_len)
                for kv_heads in (3, 8):
                    splits = choose_num_splits(md, kv_heads, num_sms=num_sms)
                    assert splits & (splits - 1) == 0 and 1 <= splits <= tuning.max_splits
                    if splits > 1:
                        assert max_seq_len // (splits // 2) >= tuning.min_split_tokens
                        assert num_reqs * kv_heads * splits // 2 < num_sms * tuning.programs_per_sm
    one_long = dataclasses.replace(decode, seq_lens_cpu=[4096], max_seq_len=8192)
    assert choose_num_splits(one_long, 3, num_sms=132) == tuning.max_splits  # batch 1: split as far as allowed
    batch_32 = dataclasses.replace(decode, seq_lens_cpu=[4096] * 32, max_seq_len=4096)
    assert choose_num_splits(batch_32, 3, num_sms=132) == 8  # 96 programs would leave 36 of 132 SMs idle
    mixed = make_batch([1, 5], [4096, 5], 8, 8, 8, 16).metadata
    assert choose_num_splits(mixed, num_kv_heads=8, num_sms=132) == 1  # prefill chunks: no split


def test_many_splits_over_short_contexts_match_reference():
    """A graph's split count is chosen for max_model_len: most splits then find no tiles of a short context."""
    batch = build(([1, 1, 1], [3, 40, 17]), (1, 3), 16, 16, torch.float32, seed=11)
    assert_matches(*run_both(batch, 0.25, num_splits=32))


# --- CUDA only: model-sized shapes and graph capture


@CUDA
@pytest.mark.parametrize("heads, head_dim", [((3, 3), 64), ((8, 4), 128)])  # SmolLM2 9/3/64; 32/8/128
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_model_sized_batches_on_cuda(heads, head_dim, dtype, block_size):
    gen = torch.Generator().manual_seed(head_dim + block_size)
    decode_lens = torch.randint(1, 2048, (16,), generator=gen).tolist()
    mixed = ([1] * 16 + [300, 77], decode_lens + [1300, 77])  # chunks behind cached context
    assert_matches(*run_both(build(mixed, heads, head_dim, block_size, dtype, seed=1), head_dim**-0.5))
    long_decodes = build(([1, 1], [8000, 3000]), heads, head_dim, block_size, dtype, seed=2)
    assert choose_num_splits(long_decodes.metadata, heads[0]) > 1
    assert_matches(*run_both(long_decodes, head_dim**-0.5))


@CUDA
def test_paged_attention_replays_in_a_cuda_graph_with_new_lengths():
    """Captured once over static buffers with a fixed length bound (so a fixed split count);
    each replay sees other lengths, block tables and cache contents copied in place."""
    heads, head_dim, block_size, dtype, bucket = (3, 3), 64, 16, torch.bfloat16, 8
    batches = [
        build(([1] * bucket, lens), heads, head_dim, block_size, dtype, seed=seed)
        for seed, lens in enumerate([[5, 700, 33, 1, 64, 1000, 17, 2], [900, 3, 48, 1023, 16, 1, 250, 640]])
    ]
    static = batches[0]
    num_blocks = max(b.key_cache.shape[0] for b in batches)
    key_cache = static.key_cache.new_zeros(num_blocks, *static.key_cache.shape[1:])
    value_cache = torch.zeros_like(key_cache)
    query = torch.zeros_like(static.query)
    block_tables = static.metadata.block_tables.new_zeros(bucket, 2048 // block_size)
    seq_lens = torch.ones_like(static.metadata.seq_lens)
    md = dataclasses.replace(
        static.metadata, seq_lens=seq_lens, block_tables=block_tables, max_seq_len=2048, scratch={}
    )
    assert choose_num_splits(md, heads[0]) > 1
    scale = head_dim**-0.5
    TRITON.paged_attention(query, key_cache, value_cache, md, scale)  # warm-up: compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = TRITON.paged_attention(query, key_cache, value_cache, md, scale)
    for batch in batches:
        key_cache.zero_()
        value_cache.zero_()
        key_cache[: batch.key_cache.shape[0]] = batch.key_cache
        value_cache[: batch.value_cache.shape[0]] = batch.value_cache
        query.copy_(batch.query)
        seq_lens.copy_(batch.metadata.seq_lens)
        block_tables.zero_()
        block_tables[:, : batch.metadata.block_tables.shape[1]] = batch.metadata.block_tables
        graph.replay()
        expected = reference.paged_attention(
            batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale
        )
        assert_matches(out, expected)
