"""What paged attention needs to know about one flattened ragged batch.

Batch layout (built by the model runner): B requests, T = sum of their query
lengths tokens, requests ordered decodes first (query length 1), then prefill
chunks. Token t of request b sits at position `seq_lens[b] - query_len[b] + i`
and attends causally to every earlier position of its own request, read from
the paged KV cache through `block_tables[b]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset; -1 = skip (padding)
    query_start_loc: torch.Tensor  # [B + 1] int32: request b's tokens are [qsl[b], qsl[b+1])
    seq_lens: torch.Tensor  # [B] int32: context length of b including this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32, rows padded with 0 (null block)
    max_query_len: int
    # max of seq_lens in an eager step; under a CUDA graph, the bound the graph was captured
    # for (max_model_len), so launch choices made from it stay fixed per graph
    max_seq_len: int
    num_decodes: int  # the first num_decodes requests have query length 1
    # Host copies for the CPU path (no device syncs to read them); a CUDA graph replays
    # with the values of its capture, so graph-safe backends read only their lengths.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # Values a backend derives from this batch once per step and reuses in every layer.
    scratch: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes
