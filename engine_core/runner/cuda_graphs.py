"""CUDA graphs for decode steps: static buffers, batch-size buckets, capture and replay.

A pure-decode step (every request has one query token) of B requests runs in the
smallest bucket >= B. Its inputs are copied into static buffers sized for the largest
bucket; rows B..bucket-1 are padding: token 0 at position 0, slot -1 (the KV write skips
it) and a context of one position in the null block 0 (attention reads one harmless key;
the row's output is never used). Sampling stays outside the graph, on the first B rows.

Graphs are captured once, largest bucket first, each right after an eager warm-up of the
same bucket (which compiles the Triton kernels for exactly these launch parameters), all
in one memory pool, as nano-vllm and vLLM do. Everything inside a graph is fixed per
bucket: the metadata's host values are the bucket's (number of requests, query length 1,
max_seq_len = max_model_len, so the split-context count too) and every per-step value
lives in the static device buffers.

Without capture (`capture=False`, as on CPU) the same padded buffers run eagerly, which is
how the CPU tests show that padding changes nothing for the real rows.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Sequence

import torch

from kernels import AttentionMetadata

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


def capture_sizes(max_batch_size: int) -> list[int]:
    """Bucket sizes: 1, 2, 4, 8, steps of 8 up to 64, then steps of 16, and the cap itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes = {s for s in (1, 2, 4, 8) if s <= max_batch_size}
    sizes.update(range(16, min(max_batch_size, 64) + 1, 8))
    sizes.update(range(80, max_batch_size + 1, 16))
    sizes.add(max_batch_size)
    return sorted(sizes)


def bucket_for(sizes: Sequence[int], num_reqs: int) -> int | None:
    """The smallest size >= num_reqs (sizes ascending), or None when none is that large."""
    index = bisect.bisect_left(sizes, num_reqs)
    return sizes[index] if index < len(sizes) else None


class DecodeGraphRunner:
    """Runs pure-decode steps of up to `sizes[-1]` requests through padded static buffers.

    `bind(kv_caches)` attaches the KV cache and, with `capture=True`, captures one graph
    per bucket; `release()` drops the graphs (before the KV cache or the weights move);
    `run()` replays the bucket's graph, or runs the padded bucket eagerly without capture.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sizes: Sequence[int],
        *,
        hidden_size: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        capture: bool,
    ) -> None:
        self.model = model
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.capture = capture
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        max_bs = self.sizes[-1]
        # ---- static inputs and output, sized for the largest bucket
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        # one query token per row, padding included: never changes
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self.kv_caches: list[KVCache] = []
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    # ---- lifecycle --------------------------------------------------------------
    def bind(self, kv_caches: list[KVCache]) -> None:
        """Use these KV caches; with capture on, capture every bucket's graph over them."""
        self.release()
        self.kv_caches = kv_caches
        if self.capture:
            self._capture_all()

    def release(self) -> None:
        """Forget the graphs, their memory pool and the KV caches they point into."""
        self.graphs = {}
        self.pool = None
        self.kv_caches = []

    # ---- one step ---------------------------------------------------------------
    def can_run(self, metadata: AttentionMetadata) -> bool:
        """True for a pure-decode step that fits the largest bucket and the static block table."""
        return (
            bool(self.kv_caches)
            and metadata.max_query_len == 1
            and metadata.num_reqs <= self.max_batch_size
            and metadata.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:  # [B, hidden], a view of the static output: use it before the next step
        """The step's hidden states: its B rows padded to the bucket, replayed or run eagerly."""
        num_reqs = metadata.num_reqs
        bucket = bucket_for(self.sizes, num_reqs)
        self._load(input_ids, positions, metadata, bucket)
        if self.capture:
            self.graphs[bucket].replay()
        else:
            padded_seq_lens = list(metadata.seq_lens_cpu) + [1] * (bucket - num_reqs)
            self.hidden[:bucket] = self._forward(bucket, self._bucket_metadata(bucket, padded_seq_lens))
        return self.hidden[:num_reqs]

    def _load(self, input_ids, positions, metadata: AttentionMetadata, bucket: int) -> None:
        """Copy the step's rows into the static buffers and reset rows up to the bucket to padding."""
        n = metadata.num_reqs
        self.input_ids[:n].copy_(input_ids)
        self.input_ids[n:bucket].zero_()
        self.positions[:n].copy_(positions)
        self.positions[n:bucket].zero_()
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.slot_mapping[n:bucket].fill_(-1)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.seq_lens[n:bucket].fill_(1)
        self.block_tables[:bucket].zero_()
        self.block_tables[:n, : metadata.block_tables.shape[1]].copy_(metadata.block_tables)

    def _bucket_metadata(self, bucket: int, seq_lens_cpu: list[int]) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.max_model_len,  # fixed per bucket: launch choices never follow the step
            num_decodes=bucket,
            query_start_loc_cpu=list(range(bucket + 1)),
            seq_lens_cpu=seq_lens_cpu,
        )

    def _forward(self, bucket: int, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(self.input_ids[:bucket], self.positions[:bucket], self.kv_caches, metadata)

    # ---- capture ----------------------------------------------------------------
    @torch.inference_mode()
    def _capture_all(self) -> None:
        started = time.perf_counter()
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)  # capture-time runs write nothing into the KV cache
        self.seq_lens.fill_(1)
        self.block_tables.zero_()
        for bucket in reversed(self.sizes):  # largest first: smaller graphs reuse its pool
            metadata = self._bucket_metadata(bucket, [1] * bucket)
            self.hidden[:bucket] = self._forward(bucket, metadata)  # warm-up: compiles kernels
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.hidden[:bucket] = self._forward(bucket, metadata)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured %d CUDA graphs for decode batches of 1..%d requests in %.1f s",
            len(self.graphs), self.max_batch_size, time.perf_counter() - started,
        )
