"""Runs one scheduled step: builds the flattened ragged batch, runs the model, samples.

The batch has no padding: B requests contribute their scheduled tokens back to back
(decodes first, then prefill chunks), with positions, a slot mapping into the paged
KV cache and one block table per request. Pooling (embedding) requests ride in the same
batches: their final hidden states are pooled instead of sampled (`_pool`). Pure-decode steps may instead go through a
`DecodeGraphRunner` (CUDA graphs, padded to a bucket); everything after the forward
pass (logits, sampling, prompt logprobs) is the same on both paths. Requests under a
structured-output constraint get their token masks computed while the forward runs
(engine_core/structured/masks.py) and applied to their logits before sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from engine_core.config import ModelArchConfig
from engine_core.cuda_graphs import DecodeGraphRunner
from engine_core.lora.runtime import LoraRuntime
from engine_core.pooling_params import PoolingType
from engine_core.request import Request
from engine_core.sampler import Sampler, build_sampling_metadata, compute_prompt_logprobs
from engine_core.structured.bitmask import apply_token_mask
from engine_core.structured.masks import StepMasks, StructuredOutputs
from engine_core.types import ModelRunnerOutput, SchedulerOutput
from kernels import AttentionBackend, AttentionMetadata


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for one block of tokens."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim * element_size
    return per_token * block_size


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        arch: ModelArchConfig,
        attention: AttentionBackend,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        cuda_graph_sizes: Sequence[int] = (),
        structured: StructuredOutputs | None = None,
        lora: LoraRuntime | None = None,
    ) -> None:
        """`cuda_graph_sizes`: decode batch buckets (empty: every step runs eagerly). On CUDA
        each bucket is captured as a graph; elsewhere the padded buckets run eagerly.
        `structured`: the engine's grammars and masks (None: constrained requests sample freely).
        `lora`: the model's adapter slots (engine_core/lora), when the engine serves LoRA."""
        self.model = model
        self.arch = arch
        self.attention = attention
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.sampler = Sampler()
        self.structured = structured
        self.lora = lora
        self.generators: dict[str, torch.Generator] = {}
        self.pooling_state: dict[str, torch.Tensor] = {}  # request id -> running sum (mean) or first row (cls)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.decode_graphs: DecodeGraphRunner | None = None
        if cuda_graph_sizes:
            self.decode_graphs = DecodeGraphRunner(
                model, cuda_graph_sizes, hidden_size=arch.hidden_size, max_model_len=max_model_len,
                block_size=block_size, device=device, dtype=dtype, capture=device.type == "cuda",
            )
        self.allocate_kv_cache()

    # ---- KV cache -------------------------------------------------------------
    def allocate_kv_cache(self) -> None:
        # one (key, value) pair per layer: [num_blocks, num_kv_heads, block_size, head_dim]
        shape = (self.num_blocks, self.arch.num_key_value_heads, self.block_size, self.arch.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(self.arch.num_hidden_layers)
        ]
        if self.decode_graphs is not None:  # (re)capture over the new cache and current weights
            self.decode_graphs.bind(self.kv_caches)

    def free_kv_cache(self) -> None:
        """Drop the KV cache and the graphs that point into it (and into the weights)."""
        if self.decode_graphs is not None:
            self.decode_graphs.release()
        self.kv_caches = []

    # ---- one step ---------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.generators.pop(request_id, None)
            self.pooling_state.pop(request_id, None)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = self._prepare_batch(scheduler_output)
        masks = None  # the constrained rows' masks, computed during the forward
        if self.structured is not None and batch.sampling_requests:
            masks = self.structured.start_masks(batch.sampling_requests)
        if self.lora is not None:
            self.lora.begin_step([r.lora_name for r in batch.requests], batch.row_counts)
        hidden = self._forward(batch)
        output = ModelRunnerOutput(sampled_token_ids={})
        if batch.sampling_requests:
            self._sample(hidden, batch, output, masks)
        if batch.prompt_logprob_spans:
            self._prompt_logprobs(hidden, batch, output)
        if batch.pooling_spans:
            self._pool(hidden, batch, output)
        return output

    def _forward(self, batch: _Batch) -> torch.Tensor:  # [T, hidden]
        md = batch.attn_metadata
        adapters = self.lora is not None and self.lora.active  # graphs are captured without adapter rows
        if self.decode_graphs is not None and not adapters and self.decode_graphs.can_run(md):
            return self.decode_graphs.run(batch.input_ids, batch.positions, md)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, md)

    def _sample(self, hidden: torch.Tensor, batch: _Batch, output: ModelRunnerOutput,
                masks: StepMasks | None) -> None:
        requests = batch.sampling_requests
        if self.lora is not None:
            self.lora.select_head_rows(batch.logits_indices.tolist())
        logits = self.model.compute_logits(hidden[batch.logits_indices])  # [N, vocab] fp32
        if masks is not None:  # before the sampler: logprobs are those of the constrained distribution
            disallowed, output.mask_timing = masks.result()
            apply_token_mask(logits, disallowed, masks.rows)
        # creates (once) the generator of each seeded request in self.generators
        metadata = build_sampling_metadata(requests, self.generators, self.device)
        sampled = self.sampler(logits, metadata)
        output.sampled_token_ids = {
            request.request_id: token for request, token in zip(requests, sampled.sampled_token_ids)
        }
        if sampled.logprobs is not None:
            output.logprobs = {
                request.request_id: logprobs
                for request, logprobs in zip(requests, sampled.logprobs)
                if logprobs is not None and request.sampling_params.logprobs is not None
            }

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: _Batch, output: ModelRunnerOutput) -> None:
        for request, token_start, position_start, count in batch.prompt_logprob_spans:
            # hidden row at position p predicts prompt token p + 1
            if self.lora is not None:
                self.lora.select_head_rows(range(token_start, token_start + count))
            logits = self.model.compute_logits(hidden[token_start:token_start + count])
            targets = request.prompt_token_ids[position_start + 1:position_start + 1 + count]
            output.prompt_logprobs[request.request_id] = compute_prompt_logprobs(
                logits, targets, request.sampling_params.prompt_logprobs
            )

    def _pool(self, hidden: torch.Tensor, batch: _Batch, output: ModelRunnerOutput) -> None:
        """Fold each pooling request's chunk into its state; pool the requests whose prompt is done.
        A chunk from position 0 starts over (the request's first chunk, or after a preemption)."""
        for request, token_start, start, count in batch.pooling_spans:
            rows = hidden[token_start:token_start + count].float()  # [count, hidden]
            kind, request_id = request.pooling.pooling_type, request.request_id
            if kind == PoolingType.MEAN:
                previous = self.pooling_state.get(request_id) if start else None
                self.pooling_state[request_id] = rows.sum(0) + (0 if previous is None else previous)
            elif kind == PoolingType.CLS and start == 0:
                self.pooling_state[request_id] = rows[0]
            if start + count < request.num_tokens:
                continue
            vector = rows[-1] if kind == PoolingType.LAST else self.pooling_state.pop(request_id)
            if kind == PoolingType.MEAN:
                vector = vector / request.num_tokens
            if request.pooling.normalize:
                vector = F.normalize(vector, dim=-1)
            output.pooled[request_id] = vector.tolist()

    # ---- batch preparation ------------------------------------------------------
    def _prepare_batch(self, scheduler_output: SchedulerOutput) -> _Batch:
        num_scheduled = scheduler_output.num_scheduled_tokens
        # decodes (one query token) first, then prefill chunks: the attention layout; within each, rows
        # of one LoRA adapter together (runs the LoRA kernels take as one: kernels/cpu_lora.py)
        requests = sorted(
            scheduler_output.scheduled_requests,
            key=lambda r: (num_scheduled[r.request_id] != 1, r.lora_name is not None, r.lora_name or ""),
        )
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        logits_indices: list[int] = []
        sampling_requests: list[Request] = []
        prompt_logprob_spans: list[tuple[Request, int, int, int]] = []
        pooling_spans: list[tuple[Request, int, int, int]] = []
        num_decodes = 0
        for request in requests:
            count = num_scheduled[request.request_id]
            # the scheduler has already advanced num_computed_tokens past this step's tokens
            end = request.num_computed_tokens
            start = end - count
            block_ids = scheduler_output.block_ids[request.request_id]
            token_start = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            block_tables.append(block_ids)
            if count == 1:
                num_decodes += 1
            if request.pooling is not None:  # pooled, never sampled
                pooling_spans.append((request, token_start, start, count))
            elif end >= request.num_tokens:  # the whole context is computed: sample the next token
                logits_indices.append(len(input_ids) - 1)
                sampling_requests.append(request)
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                num_prompt_positions = min(end, request.num_prompt_tokens - 1) - start
                prompt_logprob_spans.append((request, token_start, start, num_prompt_positions))
        device = self.device
        max_blocks = max(len(table) for table in block_tables)
        padded_tables = [table + [0] * (max_blocks - len(table)) for table in block_tables]  # 0 = null block
        attn_metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded_tables, dtype=torch.int32, device=device),
            max_query_len=max(b - a for a, b in zip(query_start_loc, query_start_loc[1:])),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return _Batch(
            requests=requests,
            row_counts=[num_scheduled[r.request_id] for r in requests],
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            attn_metadata=attn_metadata,
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
            sampling_requests=sampling_requests,
            prompt_logprob_spans=prompt_logprob_spans,
            pooling_spans=pooling_spans,
        )


@dataclass
class _Batch:
    """The tensors of one step plus which rows sample and which want prompt logprobs."""

    requests: list[Request]  # in batch order
    row_counts: list[int]  # rows of each request
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N]: the last token of each sampling request
    sampling_requests: list[Request]
    # (request, first row in the batch, first position, number of positions)
    prompt_logprob_spans: list[tuple[Request, int, int, int]]
    pooling_spans: list[tuple[Request, int, int, int]]  # the same, for every chunk of a pooling request
