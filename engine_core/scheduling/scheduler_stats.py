"""The scheduler's stats (SchedulerStats, for metrics and the load-aware router): gauges read now, counters of
the last step. Built once per step into its outputs, and on request between steps; nothing a step decides
depends on them, so they are kept out of engine_core/scheduling/scheduler.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_core.protocol import SchedulerStats

if TYPE_CHECKING:
    from engine_core.scheduling.scheduler import Scheduler


def scheduler_stats(scheduler: Scheduler) -> SchedulerStats:
    """Gauges now; counters (prefix cache, preemptions, tokens, speculative decoding) for the last step.

    A pure read: utility calls may ask between steps without taking counts from the step's metrics.
    """
    manager, lora, spec = scheduler.kv_cache_manager, scheduler.lora, scheduler.spec_decode_stats
    running_loras, waiting_loras = lora.request_counts(scheduler.requests.values()) if lora else ({}, {})
    return SchedulerStats(
        num_running_reqs=len(scheduler.running),
        num_waiting_reqs=len(scheduler.waiting),
        kv_cache_usage=manager.usage,
        num_free_blocks=manager.num_free_blocks,
        num_total_blocks=manager.num_blocks - 1,  # usable: the null block is not counted
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        num_scheduled_tokens=scheduler.num_scheduled_tokens,
        num_prompt_tokens=scheduler.num_prompt_tokens,
        num_generation_tokens=scheduler.num_generation_tokens,
        running_lora_adapters=running_loras,
        waiting_lora_adapters=waiting_loras,
        max_lora=0 if lora is None else lora.max_loras,
        spec_decode_num_drafts=spec.num_drafts,
        spec_decode_num_draft_tokens=spec.num_draft_tokens,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos),
    )
