"""Paged attention in batch-invariant mode: a token's output row is the same bits whether it runs as a decode
alone (where the default CPU kernel splits a long context across threads, and Triton across programs), as one
of many decodes, or as the last row of a prefill chunk (a taller tile of query rows)."""

from __future__ import annotations

import os

import pytest
import torch

from kernels import select_backend
from kernels.attention_metadata import AttentionMetadata
from kernels.cpu import extension as cpu_extension
from tests.kernels.paged_batch import make_batch

CONTEXT, CHUNK = 5000, 40  # long enough that a lone decode is worth splitting on two threads
BACKENDS = [
    pytest.param("cpp", marks=pytest.mark.skipif(cpu_extension.compiler() is None, reason="needs a C++ compiler")),
    pytest.param("triton", marks=pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(), reason="no Triton here")),
]


def decodes_of(batch, copies: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """The chunk's last token as `copies` decodes of the same request: [copies, H, D] queries, metadata."""
    md = batch.metadata
    query = batch.query[CHUNK - 1 : CHUNK].expand(copies, -1, -1).contiguous()
    qsl = list(range(copies + 1))
    return query, AttentionMetadata(
        slot_mapping=torch.full((copies,), -1, dtype=torch.int64, device=query.device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=query.device),
        seq_lens=md.seq_lens.repeat(copies), block_tables=md.block_tables.repeat(copies, 1),
        max_query_len=1, max_seq_len=CONTEXT, num_decodes=copies,
        query_start_loc_cpu=qsl, seq_lens_cpu=[CONTEXT] * copies,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_token_gets_the_same_row_alone_batched_and_in_a_prefill_tile(backend, dtype):
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    attention = select_backend(device, backend, batch_invariant=True)
    batch = make_batch([CHUNK], [CONTEXT], 8, 2, 64, 16, dtype, seed=7, device=device)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(max(2, threads))  # a lone long decode is split only with threads to split it over
        in_tile = attention.paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.metadata, 0.125)
        alone = attention.paged_attention(*_decode_args(batch, 1))
        batched = attention.paged_attention(*_decode_args(batch, 8))
    finally:
        torch.set_num_threads(threads)
    expected = in_tile[CHUNK - 1]
    assert torch.equal(alone[0], expected)
    assert all(torch.equal(row, expected) for row in batched)


def _decode_args(batch, copies):
    query, metadata = decodes_of(batch, copies)
    return query, batch.key_cache, batch.value_cache, metadata, 0.125
