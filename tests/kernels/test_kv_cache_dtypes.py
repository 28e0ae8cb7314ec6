"""8-bit KV caches (--kv-cache-dtype int8, fp8_e4m3): the layout (kernels/kv_cache_layout.py), the reference's
quantization, and every backend's write and attention against the reference: dequantize-then-attend.

Tolerances (atol = rtol), against the reference's fp32 attention over the dequantized cache:
- the C++ kernel's integer path (AVX-512 VNNI, head_dim 64 / 128): 5e-4 in fp32. It rounds each query row and
  each chunk's weights to 16-bit integers (one scale per row: ~2^-16 of the row's largest), measured ~1e-4;
- its portable path (every other head_dim, and CPUs without VNNI) and Triton in the interpreter: 1e-5 in fp32,
  the same arithmetic in another order;
- bf16 queries: 3e-2, as for the float caches (the output and, on the way, scores or weights round to bf16).
The writes give the reference's bytes exactly (codes and scales), on the C++ kernel and in the interpreter.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_core import config
from kernels import KV_CACHE_DTYPES, kv_bytes_per_token, kv_cache_shape, reference, resolve_kv_cache_dtype
from kernels.cpu import attention as cpu_attention
from kernels.cpu import extension as cpu_extension
from kernels.kv_cache_layout import SCALE_BYTES, hadamard_blocks, hadamard_divisors, hadamard_matrix, slab_offsets
from tests.kernels.paged_batch import DEVICE, dense_attention, make_batch, quantized, ragged_batches

CPP = pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler for the CPU kernels")
INTEGER_PATH_TOL = 5e-4
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
HEADS = [(2, 1), (1, 3), (3, 3), (1, 8)]  # (kv heads, query heads per kv head)


def tolerance(dtype: torch.dtype, head_dim: int) -> float:
    integer_path = head_dim in (64, 128) and dtype == torch.float32
    return INTEGER_PATH_TOL if integer_path else TOL[dtype]


def check(out: torch.Tensor, batch, scale: float, tol: float, window=None, softcap=None) -> None:
    """The kernel's real rows against the reference over the 8-bit cache and against the dense float64 answer
    over the dequantized context."""
    num_real = batch.metadata.query_start_loc_cpu[-1]
    expected = reference.paged_attention(batch.query.float(), batch.key_cache, batch.value_cache, batch.metadata,
                                         scale, window, softcap)
    torch.testing.assert_close(out[:num_real].float(), expected[:num_real], atol=tol, rtol=tol)
    dense = dense_attention(batch, scale, window, softcap)[:num_real]
    torch.testing.assert_close(out[:num_real].double().cpu(), dense, atol=tol, rtol=tol)


# ---- the layout and the reference -------------------------------------------------------------------------------
def test_the_flag_names_the_kernels_element_types():
    assert config.KV_CACHE_DTYPES == ("auto", *KV_CACHE_DTYPES)
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert resolve_kv_cache_dtype("int8", torch.bfloat16, torch.device("cpu")) == torch.int8
    with pytest.raises(ValueError, match="CUDA"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, torch.device("cpu"))


@pytest.mark.parametrize("block_size, head_dim", [(16, 64), (32, 48), (16, 128)])
def test_every_code_has_its_own_byte_and_the_scales_follow(block_size, head_dim):
    for kind in ("key", "value"):
        offsets = slab_offsets(kind, block_size, head_dim).flatten()
        assert sorted(offsets.tolist()) == list(range(block_size * head_dim))
    keys = slab_offsets("key", block_size, head_dim)
    assert keys[:16, :4].flatten().tolist() == list(range(64))  # dims 0..3 of 16 tokens: one vector
    values = slab_offsets("value", block_size, head_dim)
    assert values[:4, :16].t().flatten().tolist() == list(range(64))  # 16 dims of 4 tokens: one vector
    assert kv_cache_shape(5, 3, block_size, head_dim, torch.int8) == (5, 3, block_size, head_dim + SCALE_BYTES)


def test_an_int8_token_takes_about_half_a_bf16_ones_bytes():
    bf16, int8, fp32 = (kv_bytes_per_token(3, 64, dtype) for dtype in (torch.bfloat16, torch.int8, torch.float32))
    assert (bf16, int8, fp32) == (768, 396, 1536)  # 2 x 3 heads x (64 bf16 | 64 codes + an fp16 scale | 64 fp32)
    with pytest.raises(ValueError, match="multiple of 16"):
        kv_cache_shape(4, 1, 8, 64, torch.int8)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_rows_are_within_half_a_step_of_the_rotated_row(dtype):
    x = torch.randn(64, 3, 64) * torch.logspace(-3, 2, 64)[:, None, None]  # rows of every size
    x[0] = 0.0
    x[1, :, 5] = 40.0  # an outlier channel, which the rotation spreads over the row
    codes, scales = reference.quantize_kv_rows(x, dtype)
    rotated = (x.double() @ hadamard_matrix(64)).float()
    stored = codes.float() * scales.float()
    largest = rotated.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:  # half a step, the step max |H x| / 127 (its fp16 rounding included)
        assert ((stored - rotated).abs() <= largest / 127 * (0.5 + 2 ** -10)).all()
    else:  # e4m3: 3 mantissa bits, half a step of 2^-3 relative; below 2^-6 of the scale, subnormal steps
        step = torch.maximum(rotated.abs(), largest / 448 * 2 ** -6) * 2 ** -3
        assert ((stored - rotated).abs() <= step * 0.5 + 1e-7).all()
    back = reference.dequantize_kv_rows(codes, scales)  # H H = 64 I: the error's norm shrinks by 8 on the way
    assert torch.equal(back[0], torch.zeros_like(back[0]))
    torch.testing.assert_close((back - x).norm(dim=-1), (stored - rotated).norm(dim=-1) / 8, atol=1e-5, rtol=1e-3)


def test_the_rotation_is_hadamards_on_head_dims_powers_of_two():
    for head_dim, blocks in ((64, [64]), (96, [64, 32]), (48, [32, 16]), (80, [64, 16])):
        assert hadamard_blocks(head_dim) == blocks
        matrix = hadamard_matrix(head_dim)
        assert set(matrix.unique().tolist()) <= {-1.0, 0.0, 1.0} and torch.equal(matrix, matrix.t())
        assert torch.equal(matrix @ matrix, torch.diag(hadamard_divisors(head_dim)))


# ---- the C++ kernel ---------------------------------------------------------------------------------------------
@CPP
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_cpp_write_gives_the_reference_bytes(model_dtype, head_dim):
    assert cpu_extension.load()
    batch = quantized(make_batch([1, 1, 9], [5, 40, 30], 6, 2, head_dim, 16, model_dtype, seed=3, pad_tokens=3))
    key = torch.randn_like(batch.key)  # new rows, so every written slot changes
    value = torch.randn_like(batch.value)
    ours = (batch.key_cache.clone(), batch.value_cache.clone())
    theirs = (batch.key_cache.clone(), batch.value_cache.clone())
    cpu_attention.write_kv_cache(key, value, *ours, batch.metadata.slot_mapping)
    reference.write_kv_cache(key, value, *theirs, batch.metadata.slot_mapping)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert not torch.equal(ours[0], batch.key_cache)


@CPP
@settings(max_examples=50, deadline=None)
@given(
    shape=ragged_batches(max_decodes=4, max_prefills=2, max_context=150, max_chunk=40),
    heads=st.sampled_from(HEADS),
    head_dim=st.sampled_from([48, 64, 128]),  # 48: the portable path
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    window=st.sampled_from([None, 7, 40]),
    pad_tokens=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_cpp_attention_is_dequantize_then_attend(shape, heads, head_dim, block_size, dtype, window, pad_tokens,
                                                 seed):
    assert cpu_extension.load()
    (query_lens, seq_lens), (num_kv_heads, group) = shape, heads
    batch = quantized(make_batch(query_lens, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size,
                                 dtype, seed, pad_tokens), seed=seed)
    scale = head_dim ** -0.5
    out = cpu_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale,
                                        window)
    assert out.dtype == dtype
    check(out, batch, scale, tolerance(dtype, head_dim), window)
    num_real = batch.metadata.query_start_loc_cpu[-1]
    assert not out[num_real:].any(), "padding rows must come back as zeros"


@CPP
@pytest.mark.parametrize("head_dim", [64, 48])
def test_cpp_long_contexts_split_over_threads_and_softcaps(head_dim):
    """A few long decodes: their contexts split across threads and merged (flash-decoding)."""
    assert cpu_extension.load()
    batch = quantized(make_batch([1, 1, 17], [3000, 1500, 900], 8, 2, head_dim, 16, torch.float32, seed=4))
    scale = head_dim ** -0.5
    out = cpu_attention.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale,
                                        logit_softcap=5.0)
    check(out, batch, scale, tolerance(torch.float32, head_dim), softcap=5.0)


@CPP
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_batch_invariant_rows_are_the_same_bits_alone_and_in_a_batch(dtype):
    """A long decode alone (which the default would split across threads) and beside others and a prefill."""
    assert cpu_extension.load()
    batch = quantized(make_batch([1, 1, 1, 24], [2000, 35, 70, 90], 9, 3, 64, 16, dtype, seed=5))
    args = (batch.key_cache, batch.value_cache)
    together = cpu_attention.paged_attention(batch.query, *args, batch.metadata, 0.125, batch_invariant=True)
    alone = cpu_attention.paged_attention(batch.query[:1], *args, _first_request(batch.metadata), 0.125,
                                          batch_invariant=True)
    assert torch.equal(alone[0], together[0])


def _first_request(md):
    from kernels import AttentionMetadata

    return AttentionMetadata(
        slot_mapping=md.slot_mapping[:1], query_start_loc=md.query_start_loc[:2], seq_lens=md.seq_lens[:1],
        block_tables=md.block_tables[:1], max_query_len=1, max_seq_len=md.seq_lens_cpu[0], num_decodes=1,
        query_start_loc_cpu=md.query_start_loc_cpu[:2], seq_lens_cpu=md.seq_lens_cpu[:1])


# ---- Triton (the GPU, or its CPU interpreter) -------------------------------------------------------------------
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_triton_write_gives_the_reference_codes(cache_dtype, model_dtype):
    from kernels.triton import kv_write

    batch = quantized(make_batch([1, 6], [9, 20], 4, 2, 64, 16, model_dtype, seed=6, pad_tokens=2), cache_dtype)
    ours = (batch.key_cache.to(DEVICE), batch.value_cache.to(DEVICE))
    theirs = (batch.key_cache.clone(), batch.value_cache.clone())
    kv_write.write_kv_cache(batch.key.to(DEVICE), batch.value.to(DEVICE), *ours, batch.metadata.slot_mapping)
    reference.write_kv_cache(batch.key.cpu(), batch.value.cpu(), *theirs, batch.metadata.slot_mapping.cpu())
    for mine, expected, kind in zip(ours, theirs, ("key", "value")):
        if DEVICE.type == "cpu":  # the interpreter divides exactly: the same bytes
            assert torch.equal(mine.view(torch.int8), expected.view(torch.int8))
        else:  # a GPU's division may land a near-tie one code away
            step = 1 / 127 if cache_dtype == torch.int8 else 2 ** -3
            back, want = (reference.dequantize_kv_cache(c.cpu(), kind) for c in (mine, expected))
            assert torch.allclose(back, want, atol=step * want.abs().amax(-1, keepdim=True).max().item(), rtol=0)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_triton_attention_is_dequantize_then_attend(cache_dtype, dtype, num_splits):
    from kernels.triton import paged_attention as triton_attention

    batch = quantized(make_batch([1, 1, 12], [40, 77, 50], 6, 2, 64, 16, dtype, seed=7, pad_tokens=1), cache_dtype)
    md = batch.metadata
    scale = 0.125
    out = triton_attention.paged_attention(batch.query.to(DEVICE), batch.key_cache.to(DEVICE),
                                           batch.value_cache.to(DEVICE), _on(md, DEVICE), scale,
                                           num_splits=num_splits).cpu()
    check(out, batch, scale, TOL[dtype])


def _on(md, device):
    from dataclasses import replace

    return replace(md, slot_mapping=md.slot_mapping.to(device), query_start_loc=md.query_start_loc.to(device),
                   seq_lens=md.seq_lens.to(device), block_tables=md.block_tables.to(device), scratch={})
