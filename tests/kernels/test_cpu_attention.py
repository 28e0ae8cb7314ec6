"""The C++ CPU paged-attention kernel (kernels/cpu/attention.py) against the torch reference
and a dense float64 attention computed from scratch.

Skipped only where no C++ compiler exists; with one, a failed build fails these tests.
Tolerances (atol = rtol): fp32 1e-5 (both sides accumulate in fp32, in different orders);
bf16 3e-2, a few bf16 ulps, as for the Triton kernels: the reference rounds scores and
probabilities to bf16; the C++ kernel keeps scores in fp32 and, on CPUs with AVX512-BF16, rounds
the probabilities to bf16 as it multiplies them by V (two keys per vdpbf16ps), as the Hugging Face
modules do before their P @ V.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import reference
from kernels.cpu import attention as cpu_attention
from kernels.cpu import extension as cpu_extension
from tests.kernels.paged_batch import cache_by_slot, dense_attention, make_batch, ragged_batches

pytestmark = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# (num_kv_heads, queries per kv head): GQA ratios 1, 3 and 8 (SmolLM2 is (3, 3))
HEADS = [(2, 1), (1, 3), (3, 3), (1, 8)]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_extension.load(), "a C++ compiler is present but the CPU kernels did not build (see the log)"


def build(shape, heads, head_dim, block_size, dtype, seed=0, pad_tokens=0):
    (query_lens, seq_lens), (num_kv_heads, group) = shape, heads
    return make_batch(
        query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype, seed, pad_tokens
    )


def check(batch, scale=None):
    """The kernel's real rows against the dense answer, and in fp32 against the reference too
    (in bf16 the reference's own rounding of scores strays further from the dense answer)."""
    scale = scale or batch.query.shape[-1] ** -0.5
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale)
    out = cpu_attention.paged_attention(*args)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    num_real = batch.metadata.query_start_loc_cpu[-1]
    tol = TOL[out.dtype]
    dense = dense_attention(batch, scale)[:num_real]
    torch.testing.assert_close(out[:num_real].double(), dense, atol=tol, rtol=tol)
    if out.dtype == torch.float32:
        expected = reference.paged_attention(*args)[:num_real]
        torch.testing.assert_close(out[:num_real], expected, atol=tol, rtol=tol)
    return out


# head_dim 64 and 128 take the vector path; 16 and 48 (not a multiple of 32) the scalar one.
@settings(max_examples=60, deadline=None)
@given(
    shape=ragged_batches(max_decodes=4, max_prefills=2, max_context=150, max_chunk=40),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([16, 48, 64, 128]),
    block_size=st.sampled_from([1, 4, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    pad_tokens=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_ragged_batches_match_dense_and_reference(shape, heads, head_dim, block_size, dtype, pad_tokens, seed):
    batch = build(shape, heads, head_dim, block_size, dtype, seed, pad_tokens)
    out = check(batch)
    num_real = batch.metadata.query_start_loc_cpu[-1]
    assert not out[num_real:].any(), "padding rows must come back as zeros"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 128])
def test_long_contexts_span_many_chunks(dtype, block_size):
    """Contexts of many 64-key chunks and many blocks (prefetch, online-softmax rescaling),
    with peaked scores so a wrong rescale shows."""
    batch = build(([1, 1, 1], [1, 700, 2100]), (3, 3), 64, block_size, dtype, seed=3)
    check(batch, scale=1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_over_a_prefix_cross_tiles(dtype):
    """Query chunks longer than one tile of rows (32 / GQA ratio), each after a cached prefix,
    beside decodes: the causal cut moves inside a tile and inside a 64-key chunk."""
    batch = build(([1, 1, 45, 70], [300, 9, 45 + 77, 70 + 130]), (3, 3), 64, 16, dtype, seed=5, pad_tokens=2)
    check(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(1, 8), (3, 3)])
def test_few_long_decodes_split_their_contexts_across_threads(dtype, heads):
    """Fewer (request, kv head) items than twice the threads: each long context runs as
    several splits whose partial softmax results are merged (flash-decoding)."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        check(build(([1], [1000]), heads, 64, 16, dtype, seed=11), scale=0.5)
        check(build(([1, 1], [300, 129]), heads, 128, 16, dtype, seed=12))
    finally:
        torch.set_num_threads(threads)


def test_threads_give_the_same_answer():
    batch = build(([1] * 12 + [33], [90] * 12 + [160]), (3, 3), 64, 16, torch.bfloat16, seed=9)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_attention.paged_attention(*args)
        torch.set_num_threads(max(2, threads))
        many = cpu_attention.paged_attention(*args)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, many, atol=0, rtol=0)  # each item is computed the same way by any thread


def test_float16_falls_back_to_the_reference():
    batch = make_batch([1, 5], [9, 5], 4, 2, 16, 16, torch.float16, seed=1)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.metadata, 0.25)
    torch.testing.assert_close(cpu_attention.paged_attention(*args), reference.paged_attention(*args))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_skips_padding_and_reads_strided_rows(dtype):
    batch = make_batch([1, 5], [9, 5], 6, 2, 64, 16, dtype, pad_tokens=3, seed=1)
    md = batch.metadata
    # key and value as the model passes them: views into one fused qkv row, not contiguous
    qkv = torch.cat([batch.query, batch.key, batch.value], dim=1)  # [T, H + 2 Hkv, D]
    key, value = qkv[:, 6:8], qkv[:, 8:10]
    key_cache, value_cache = torch.zeros_like(batch.key_cache), torch.zeros_like(batch.value_cache)
    cpu_attention.write_kv_cache(key, value, key_cache, value_cache, md.slot_mapping, md)
    expected_k, expected_v = torch.zeros_like(key_cache), torch.zeros_like(value_cache)
    reference.write_kv_cache(batch.key, batch.value, expected_k, expected_v, md.slot_mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)  # copies, no arithmetic
    keep = md.slot_mapping >= 0
    assert torch.equal(cache_by_slot(key_cache)[md.slot_mapping[keep]], batch.key[keep])


def test_a_slot_outside_the_cache_is_an_error_not_a_write():
    batch = make_batch([1], [4], 2, 2, 16, 16, torch.float32)
    num_slots = batch.key_cache.shape[0] * batch.key_cache.shape[2]
    bad = torch.tensor([num_slots], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_attention.write_kv_cache(batch.key, batch.value, batch.key_cache, batch.value_cache, bad)
