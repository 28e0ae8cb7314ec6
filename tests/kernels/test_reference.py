"""The torch reference against a dense per-request attention computed from scratch.

On DEVICE: the GPU when there is one, else the CPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import reference
from tests.kernels.paged_batch import DEVICE, cache_by_slot, dense_attention, make_batch, ragged_batches

TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def assert_close_to_dense(actual: torch.Tensor, expected: torch.Tensor, num_valid: int) -> None:
    tol = TOL[actual.dtype]
    torch.testing.assert_close(
        actual[:num_valid].cpu().double(), expected[:num_valid], atol=tol, rtol=tol
    )


@settings(max_examples=40, deadline=None)
@given(
    shape=ragged_batches(),
    heads=st.sampled_from([(2, 2), (3, 1), (8, 1), (6, 2)]),
    head_dim=st.sampled_from([8, 16]),
    block_size=st.sampled_from([16, 32]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**16),
)
def test_reference_matches_dense(shape, heads, head_dim, block_size, dtype, seed):
    query_lens, seq_lens = shape
    batch = make_batch(query_lens, seq_lens, *heads, head_dim, block_size, dtype, seed, device=DEVICE)
    scale = head_dim**-0.5
    out = reference.paged_attention(
        batch.query, batch.key_cache, batch.value_cache, batch.metadata, scale
    )
    assert out.shape == batch.query.shape and out.dtype == dtype
    assert_close_to_dense(out, dense_attention(batch, scale), batch.query.shape[0])


def test_reference_write_kv_cache_skips_padding():
    batch = make_batch([1, 5], [9, 5], 4, 2, 16, 16, pad_tokens=3, seed=1, device=DEVICE)
    md = batch.metadata
    key_cache = torch.zeros_like(batch.key_cache)
    value_cache = torch.zeros_like(batch.value_cache)
    reference.write_kv_cache(batch.key, batch.value, key_cache, value_cache, md.slot_mapping)
    flat_k, flat_v = cache_by_slot(key_cache), cache_by_slot(value_cache)
    keep = md.slot_mapping >= 0
    assert torch.equal(flat_k[md.slot_mapping[keep]], batch.key[keep])
    assert torch.equal(flat_v[md.slot_mapping[keep]], batch.value[keep])
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    written[md.slot_mapping[keep]] = True
    assert not flat_k[~written].any() and not flat_v[~written].any()


@pytest.mark.parametrize("block_size", [16, 32])
def test_gather_context_follows_shuffled_block_table(block_size):
    batch = make_batch([4], [45], 2, 2, 8, block_size, seed=2, device=DEVICE)
    gathered = reference.gather_context(batch.key_cache, batch.metadata.block_tables[:1], 45)  # [1, Hkv, L, D]
    assert torch.equal(gathered[0].transpose(0, 1).cpu(), batch.dense_keys[0])
