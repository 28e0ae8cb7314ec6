"""The scheduler's load and counters after one step (vLLM's SchedulerStats)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # speculative decoding, this step (vLLM's SpecDecodingStats): requests verified, draft tokens verified and
    # accepted, and accepted drafts by position (entry i: a request's (i+1)-th draft)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
