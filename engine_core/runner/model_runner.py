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

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Sequence

import torch
import torch.nn.functional as F

from engine_core.config import ModelArchConfig
from engine_core.lora.runtime import LoraRuntime
from engine_core.protocol import PoolingType
from engine_core.request import Request
from engine_core.runner.cuda_graphs import DecodeGraphRunner
from engine_core.runner.host_to_device import to_device
from engine_core.runner.kv_cache_tensors import allocate_kv_caches
from engine_core.runner.sampler import Sampler, build_sampling_metadata, compute_prompt_logprobs
from engine_core.runner.sampling_metadata import SamplingMetadata
from engine_core.runner.step_output import StepOutput
from engine_core.spec_decode.speculator import Speculator
from engine_core.spec_decode.verification import VerifyBatch
from engine_core.structured.bitmask import apply_token_mask
from engine_core.structured.masks import StepMasks, StructuredOutputs
from engine_core.types import ModelRunnerOutput, SchedulerOutput
from kernels import AttentionBackend, AttentionMetadata


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
        kv_cache_dtype: torch.dtype | None = None,
        max_model_len: int,
        cuda_graph_sizes: Sequence[int] = (),
        structured: StructuredOutputs | None = None,
        lora: LoraRuntime | None = None,
        spec: Speculator | None = None,
    ) -> None:
        """`cuda_graph_sizes`: decode batch buckets (empty: every step runs eagerly). On CUDA
        each bucket is captured as a graph; elsewhere the padded buckets run eagerly.
        `structured`: the engine's grammars and masks (None: constrained requests sample freely).
        `lora`: the model's adapter slots (engine_core/lora), when the engine serves LoRA.
        `spec`: speculative decoding's proposer and verification (engine_core/spec_decode), when it is on."""
        self.model = model
        self.arch = arch
        self.attention = attention
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype  # the KV cache's element type (kernels/kv_cache_layout.py)
        self.sampler = Sampler()
        self.structured = structured
        self.lora = lora
        self.spec = spec
        self.generators: dict[str, torch.Generator] = {}
        self.pooling_state: dict[str, torch.Tensor] = {}  # request id -> running sum (mean) or first row (cls)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._last_step: StepOutput | None = None  # its sampled tokens feed the next step's placeholders
        self.decode_graphs: DecodeGraphRunner | None = None
        if cuda_graph_sizes:
            self.decode_graphs = DecodeGraphRunner(
                model, cuda_graph_sizes, hidden_size=arch.hidden_size, max_model_len=max_model_len,
                block_size=block_size, device=device, dtype=dtype, capture=device.type == "cuda",
            )
        self.allocate_kv_cache()

    # ---- KV cache -------------------------------------------------------------
    def allocate_kv_cache(self) -> None:
        """One (key, value) pair per layer (engine_core/runner/kv_cache_tensors.py), at start-up and on wake-up."""
        self.kv_caches = allocate_kv_caches(self.arch, self.num_blocks, self.block_size, self.kv_cache_dtype,
                                            self.device)
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
        batch = self.prepare_step(scheduler_output)
        if batch is None:
            return ModelRunnerOutput(sampled_token_ids={})
        masks = self.start_masks(batch)  # the constrained rows' masks, computed during the forward
        hidden = self.forward(batch)
        step = self.new_step_output(batch)
        self.compute_outputs(step, hidden, self.sampling_metadata(batch), masks)
        output = step.result()
        if self.spec is not None:  # the next step's drafts
            self.spec.propose(batch, output)
        return output

    # The phases of a step, for engine_core/overlap.py, which runs forward() and compute_outputs() on its
    # device queue and the rest on the host thread.
    def prepare_step(self, scheduler_output: SchedulerOutput) -> _Batch | None:
        """The step's inputs (None for an empty step); forgets the finished requests' state."""
        if self.spec is not None:
            self.spec.forget(scheduler_output.finished_request_ids)
        for request_id in scheduler_output.finished_request_ids:
            self.generators.pop(request_id, None)
            self.pooling_state.pop(request_id, None)
        if scheduler_output.is_empty:
            return None
        return self._prepare_batch(scheduler_output)

    def start_masks(self, batch: _Batch) -> StepMasks | None:
        """Start the constrained rows' masks (their grammars must have seen every earlier token)."""
        if self.structured is None or not batch.sampling_requests:
            return None
        return self.structured.start_masks(batch.sampling_requests)

    def sampling_metadata(self, batch: _Batch) -> SamplingMetadata | None:
        # creates (once) the generator of each seeded request in self.generators
        if not batch.sampling_requests:
            return None
        return build_sampling_metadata(batch.sampling_requests, self.generators, self.device)

    def new_step_output(self, batch: _Batch) -> StepOutput:
        """The step's output to be: the next step's placeholder inputs read its sampled tokens."""
        step = StepOutput(batch)
        self._last_step = step
        return step

    def forward(self, batch: _Batch) -> torch.Tensor:  # [T, hidden]; under inference_mode
        if batch.placeholder_rows is not None:  # tokens the step before sampled, still on the device
            source = batch.placeholder_source.sampled
            batch.input_ids[batch.placeholder_rows] = source[batch.placeholder_source_rows]
        if self.lora is not None:  # here, on the device queue: the step before has sampled with its own rows
            self.lora.begin_step([r.lora_name for r in batch.requests], batch.row_counts)
        md = batch.attn_metadata
        adapters = self.lora is not None and self.lora.active  # graphs are captured without adapter rows
        if self.decode_graphs is not None and not adapters and self.decode_graphs.can_run(md):
            return self.decode_graphs.run(batch.input_ids, batch.positions, md)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, md)

    def compute_outputs(self, step: StepOutput, hidden: torch.Tensor, metadata: SamplingMetadata | None,
                        masks: StepMasks | None) -> None:
        """Under inference_mode: sample (the tokens stay on the device, copied back without blocking),
        prompt logprobs, pooling."""
        batch, output = step.batch, step.output
        if step.requests or batch.verify is not None:
            self._sample(hidden, step, metadata, masks)
        if batch.prompt_logprob_spans:
            self._prompt_logprobs(hidden, batch, output)
        if batch.pooling_spans:
            self._pool(hidden, batch, output)

    def _sample(self, hidden: torch.Tensor, step: StepOutput, metadata: SamplingMetadata,
                masks: StepMasks | None) -> None:
        output = step.output
        batch = step.batch
        if self.lora is not None:
            self.lora.select_head_rows(batch.logits_rows)
        rows = hidden if batch.every_row_samples else hidden[batch.logits_indices]
        logits = self.model.compute_logits(rows)  # [N, vocab] fp32
        if batch.verify is not None:  # speculative decoding: the last rows verify drafts (engine_core/spec_decode)
            logits = self.spec.verify(self.sampler, logits, batch.verify, self.generators, output)
            if not step.requests:
                return
        if masks is not None:  # before the sampler: logprobs are those of the constrained distribution
            disallowed, output.mask_timing = masks.result()
            apply_token_mask(logits, disallowed, masks.rows)
        sampled, logprobs = self.sampler.sample(logits, metadata)
        step.set_sampled(sampled)
        if logprobs is not None:
            output.logprobs = {
                request.request_id: row_logprobs
                for request, row_logprobs in zip(step.requests, logprobs)
                if row_logprobs is not None and request.sampling_params.logprobs is not None
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
        # decodes (one query token) first, then prefill chunks: the attention layout; with LoRA, each adapter's
        # rows together within them (runs the LoRA kernels take as one: kernels/cpu/lora.py)
        only_decodes = scheduler_output.total_num_scheduled_tokens == len(num_scheduled)
        requests = scheduler_output.scheduled_requests if only_decodes and self.lora is None else sorted(
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
        verify = VerifyBatch()  # speculative decoding: the requests with drafts and their rows
        placeholder_rows: list[int] = []
        placeholder_source_rows: list[int] = []
        num_decodes = 0
        for request in requests:
            count = num_scheduled[request.request_id]
            # the scheduler has already advanced num_computed_tokens past this step's tokens
            end = request.num_computed_tokens
            start = end - count
            block_ids = scheduler_output.block_ids[request.request_id]
            token_start = len(input_ids)
            tokens = request.all_token_ids[start:end]
            drafts = scheduler_output.spec_token_ids.get(request.request_id)
            if drafts:
                tokens += drafts
            if len(tokens) < count:  # overlapped steps: the token the step in flight samples (forward())
                placeholder_rows.append(token_start + len(tokens))
                placeholder_source_rows.append(self._last_step.row_of[request.request_id])
                tokens.append(0)
            input_ids.extend(tokens)
            if count == 1:  # a decode: one position, no ranges to build (host time per step, docs/gpu.md)
                num_decodes += 1
                positions.append(start)
                slot_mapping.append(block_ids[start // block_size] * block_size + start % block_size)
            else:
                positions.extend(range(start, end))
                slot_mapping.extend(block_ids[p // block_size] * block_size + p % block_size
                                    for p in range(start, end))
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            block_tables.append(block_ids)
            if request.pooling is not None:  # pooled, never sampled
                pooling_spans.append((request, token_start, start, count))
            elif drafts:  # every row's logits: the last token's and each draft's
                verify.add(request, drafts, range(token_start, len(input_ids)))
            elif end >= request.num_tokens:  # the whole context is computed: sample the next token
                logits_indices.append(len(input_ids) - 1)
                sampling_requests.append(request)
            if request.sampling_params.prompt_logprobs is not None and start < request.num_prompt_tokens - 1:
                num_prompt_positions = min(end, request.num_prompt_tokens - 1) - start
                prompt_logprob_spans.append((request, token_start, start, num_prompt_positions))
        logits_indices += verify.rows  # the verified rows come last
        max_blocks = max(len(table) for table in block_tables)
        padded_tables = [table + [0] * (max_blocks - len(table)) for table in block_tables]  # 0 = null block
        attn_metadata = AttentionMetadata(
            slot_mapping=self._to_device(slot_mapping, torch.int64),
            query_start_loc=self._to_device(query_start_loc, torch.int32),
            seq_lens=self._to_device(seq_lens, torch.int32),
            block_tables=self._to_device(padded_tables, torch.int32),
            max_query_len=1 if only_decodes else max(end - start for start, end in pairwise(query_start_loc)),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        return _Batch(
            input_ids=self._to_device(input_ids, torch.int64),
            positions=self._to_device(positions, torch.int64),
            attn_metadata=attn_metadata,
            logits_indices=self._to_device(logits_indices, torch.int64),
            every_row_samples=len(logits_indices) == len(input_ids),
            sampling_requests=sampling_requests,
            prompt_logprob_spans=prompt_logprob_spans,
            pooling_spans=pooling_spans,
            placeholder_rows=self._to_device(placeholder_rows, torch.int64) if placeholder_rows else None,
            placeholder_source=self._last_step if placeholder_rows else None,
            placeholder_source_rows=self._to_device(placeholder_source_rows, torch.int64) if placeholder_rows else None,
            requests=requests,
            row_counts=[num_scheduled[r.request_id] for r in requests],
            logits_rows=logits_indices,
            verify=verify if verify.requests else None,
        )

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)  # never waits for the forward in flight


@dataclass
class _Batch:
    """The tensors of one step plus which rows sample and which want prompt logprobs."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N]: the last token of each sampling request, then every verified row
    every_row_samples: bool  # N == T (every request decodes and samples): logits_indices is 0..T-1
    sampling_requests: list[Request]
    # (request, first row in the batch, first position, number of positions)
    prompt_logprob_spans: list[tuple[Request, int, int, int]]
    pooling_spans: list[tuple[Request, int, int, int]]  # the same, for every chunk of a pooling request
    # Overlapped steps: input rows whose token the step before sampled, and where in its output to find it.
    placeholder_rows: torch.Tensor | None = None
    placeholder_source: StepOutput | None = None
    placeholder_source_rows: torch.Tensor | None = None
    # LoRA: the requests in batch order, their rows, and the sampled rows as a host list
    requests: list[Request] = field(default_factory=list)
    row_counts: list[int] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    verify: VerifyBatch | None = None  # speculative decoding: the requests whose drafts the last logits rows verify
