"""The engine core's own step messages (never sent): SchedulerOutput goes from the scheduler to the model
runner, ModelRunnerOutput comes back. What crosses to the frontend is in engine_core/protocol/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_core.protocol import TokenLogprobs

if TYPE_CHECKING:
    from engine_core.request import Request
    from engine_core.structured.masks import MaskTiming


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
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> drafts its step verifies

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
    # speculative decoding, by request id: the tokens verified (accepted drafts, one sampled), the next step's drafts
    verified_token_ids: dict[str, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
