"""A request's life inside the engine core: tokens, progress, status, block hashes."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_core.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    FinishReason,
    PoolingParams,
    SamplingParams,
)
from engine_core.protocol.block_hash import BlockHash, hash_block_tokens, root_hash

if TYPE_CHECKING:
    from engine_core.structured.matcher import GrammarMatcher

logger = logging.getLogger(__name__)


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(eq=False)
class Request:
    """Token ids in, token ids out; `num_computed_tokens` catches up with `num_tokens`.

    `block_hashes` holds one chained hash per *full* block of `all_token_ids` and
    grows as output tokens are appended (prefix caching only ever uses full blocks).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_size: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    priority: int = 0
    max_model_len: int | None = None
    pooling: PoolingParams | None = None  # set: pooled (an embedding), never sampled
    lora_name: str | None = None  # its LoRA adapter; block hashes are rooted in it (protocol/block_hash.py)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must not be empty")
        self.arrival_time = self.arrival_time or time.time()
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Overlapped steps (engine_core/overlap.py): tokens a step in flight samples, not yet appended.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_token_id: int | None = None  # the stop token (EOS or stop_token_ids) that ended it
        self.block_hashes: list[BlockHash] = []
        self.events: list[EngineCoreEvent] = []  # recorded only when the scheduler logs stats
        self.grammar: GrammarMatcher | None = None  # structured output: set by the engine, fed every output token
        self.spec_token_ids: list[int] = []  # drafts for its next decode (engine_core/spec_decode)
        self._update_block_hashes()
        # The most tokens this request may produce.
        limit = self.sampling_params.max_tokens
        if self.max_model_len is not None:
            room = self.max_model_len - self.num_prompt_tokens
            limit = room if limit is None else min(limit, room)
        self.max_output_tokens: int | None = limit

    # ---- sizes ----------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_ahead(self) -> int:
        """num_tokens plus the tokens still in flight: how far the scheduler may compute."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.status.finish_reason

    # ---- growth ---------------------------------------------------------------
    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        if self.grammar is not None:
            for token_id in token_ids:
                self.grammar.accept(token_id)
        if len(self.all_token_ids) >= (len(self.block_hashes) + 1) * self.block_size:  # a block just filled
            self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        size = self.block_size
        parent = self.block_hashes[-1] if self.block_hashes else root_hash(self.lora_name)
        for start in range(len(self.block_hashes) * size, self.num_tokens - size + 1, size):
            parent = hash_block_tokens(parent, self.all_token_ids[start:start + size])
            self.block_hashes.append(parent)

    # ---- events (for tracing and latency metrics) ------------------------------
    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append(EngineCoreEvent(event_type, time.time()))

    def take_events(self) -> list[EngineCoreEvent] | None:
        """The events since the last call (None if there are none)."""
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def check_stop(self) -> bool:
        """After a token was appended: set a finished status if the request is done."""
        if self.num_output_tokens == 0:
            return False
        if self.grammar is not None and self._check_grammar_stop():
            return True
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_token_id = last
                return True
        if self.max_output_tokens is not None and self.num_output_tokens >= self.max_output_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _check_grammar_stop(self) -> bool:
        """A complete structure ends the request (STOP, even before min_tokens: nothing may follow it);
        a token the grammar refused (a masking bug, or a grammar past llguidance's limits) aborts it."""
        grammar = self.grammar
        if grammar.rejected_token is not None or grammar.matcher.is_error():
            logger.error("request %s: structured.%s matcher failed after %d tokens (token %s): %s", self.request_id,
                         grammar.kind, self.num_output_tokens, grammar.rejected_token, grammar.error)
            self.status = RequestStatus.FINISHED_ABORTED
            return True
        if grammar.is_terminated:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        return False
