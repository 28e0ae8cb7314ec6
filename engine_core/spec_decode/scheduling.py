"""The scheduler's side of speculative decoding: how many of a request's drafts its step verifies, and the counts
for metrics. Pure bookkeeping, like the scheduler.

A decoding request with drafts is scheduled 1 + k tokens: its last token and the k drafts, whose KV slots are
allocated like a prompt chunk's. Its decode token rides on top of the step's budget as every decode does; the drafts
spend the budget, as a prompt chunk does. After the step the scheduler keeps the tokens the verification emitted and
gives back what the rejected drafts held (`end_verification`): `num_computed_tokens` steps back to the
last accepted position and blocks left with no token in them return to the pool. Only blocks full of the request's
own tokens are ever hashed (`Request.block_hashes` never sees a draft), so the prefix cache cannot index a rejected
draft's KV.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.request import Request
from engine_core.scheduling.kv_cache_manager import KVCacheManager


def fit_drafts(request: Request, budget: int, max_model_len: int) -> list[int]:
    """The request's drafts its next step can verify: within the step's token budget, the model's context and
    max_tokens (a verification emits one token more than the drafts it accepts)."""
    room = min(budget, max_model_len - request.num_tokens - 1)
    if request.max_output_tokens is not None:
        room = min(room, request.max_output_tokens - request.num_output_tokens - 1)
    return request.spec_token_ids[:max(room, 0)]


def end_verification(request: Request, num_drafts: int, num_emitted: int, kv_cache_manager: KVCacheManager,
                     stats: SpecDecodeStats) -> None:
    """After a verification emitted `num_emitted` tokens (all but the last accepted drafts): the rejected drafts'
    positions are computed no more, and the blocks that held only them go back to the pool."""
    num_accepted = num_emitted - 1
    request.num_computed_tokens -= num_drafts - num_accepted
    kv_cache_manager.free_tail(request)
    stats.observe(num_drafts, num_accepted)


@dataclass
class SpecDecodeStats:
    """One step's verifications (vLLM's SpecDecodingStats): drafts checked, their tokens, the tokens accepted, and
    how often the draft at each position was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        per_pos = self.num_accepted_tokens_per_pos
        per_pos.extend([0] * (num_accepted_tokens - len(per_pos)))
        for pos in range(num_accepted_tokens):
            per_pos[pos] += 1
