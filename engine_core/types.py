"""Plain messages that cross the engine core's boundaries.

EngineCoreRequest comes in (from the frontend, over gRPC or in-process);
SchedulerOutput goes from the scheduler to the model runner; ModelRunnerOutput
comes back; EngineCoreOutputs (one per step) goes out. Nothing here knows about
torch or gRPC.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

# FinishReason and TokenLogprobs are shared with the frontend, so they live in sampling_params.
from engine_core.pooling_params import PoolingParams
from engine_core.sampling_params import FinishReason, SamplingParams, TokenLogprobs  # noqa: F401

if TYPE_CHECKING:
    from engine_core.request import Request
    from engine_core.structured.masks import MaskTiming


@dataclass(frozen=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first under the priority policy
    trace_headers: dict[str, str] | None = None
    pooling: PoolingParams | None = None  # set: an embedding request, pooled instead of sampled
    lora_name: str | None = None  # the LoRA adapter to run it with (engine_core/lora); None: the base model


# ---- scheduler -> model runner ----------------------------------------------------
@dataclass
class SchedulerOutput:
    """What to run this step. Requests appear in batch order."""

    scheduled_requests: list["Request"]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step
    total_num_scheduled_tokens: int
    block_ids: dict[str, list[int]]  # request id -> its KV block table
    num_common_prefix_blocks: int = 0
    preempted_request_ids: set[str] = field(default_factory=set)
    finished_request_ids: set[str] = field(default_factory=set)  # since the last step

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# ---- model runner -> scheduler ----------------------------------------------------
@dataclass
class ModelRunnerOutput:
    """Tokens sampled this step; only requests whose prompt is fully computed sample."""

    sampled_token_ids: dict[str, int]  # request id -> new token id
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # request id -> logprobs of the prompt tokens computed this step (position i: token i+1)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # request id -> its pooled vector
    mask_timing: "MaskTiming | None" = None  # structured-output masks this step, if any row had one


# ---- engine core -> frontend ------------------------------------------------------
class EngineCoreEventType(enum.IntEnum):
    """What happened to a request in the scheduler (first token and finish show in the outputs)."""

    QUEUED = 1
    SCHEDULED = 2  # admitted from the waiting queue (also after a preemption)
    PREEMPTED = 3


@dataclass(frozen=True)
class EngineCoreEvent:
    type: EngineCoreEventType
    timestamp: float  # time.time() in the engine


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None  # since the last output; only when the scheduler records them
    embedding: list[float] | None = None  # a pooling request's vector, in its finishing output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, 0..1
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0  # prompt tokens of the requests admitted this step (resumed ones too)
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0  # this step
    num_scheduled_tokens: int = 0  # this step
    num_prompt_tokens: int = 0  # this step: prompt lengths of requests that sampled their first token
    num_generation_tokens: int = 0  # this step: tokens sampled
    # LoRA (vLLM's lora_requests_info): requests per adapter, running and waiting; max_lora 0 when LoRA is off
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    max_lora: int = 0


@dataclass
class KVCacheEvents:
    """Prefix-cache blocks indexed and evicted since the last report (vLLM's KV events), by chained hash
    (engine_core/block_hash.py). `cleared`: forget every hash first (a reset, or a full snapshot)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: bool = False


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    kv_events: KVCacheEvents | None = None  # only when the engine records them
    mask_timing: "MaskTiming | None" = None  # engine-local (step metrics), never sent
