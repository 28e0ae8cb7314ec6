"""What the engine core sends back: per-request news of one step, and the step's message around it.

One `EngineCoreOutputs` is one message of the engine's stream: a step's outputs, and (on the same
message) refusals, a utility call's answer, the scheduler's stats, prefix-cache events and the engine's
state when it changed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine_core.protocol.engine_state import EngineState
from engine_core.protocol.finish_reason import FinishReason
from engine_core.protocol.kv_events import KVCacheEvents
from engine_core.protocol.logprobs import TokenLogprobs
from engine_core.protocol.request_error import RequestError
from engine_core.protocol.scheduler_stats import SchedulerStats
from engine_core.protocol.utility import UtilityResult


class EngineCoreEventType(enum.IntEnum):
    """What happened to a request in the scheduler (first token and finish show in the outputs);
    numbered like tandem.v1.EngineCoreEventType."""

    QUEUED = 1
    SCHEDULED = 2  # admitted from the waiting queue (also after a preemption)
    PREEMPTED = 3


@dataclass(frozen=True)
class EngineCoreEvent:
    type: EngineCoreEventType
    timestamp: float  # time.time() in the engine


@dataclass
class EngineCoreOutput:
    """One request's news from one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None  # position i: logprobs of prompt token i + 1
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None  # the stop token (EOS or a stop_token_ids entry) that ended it
    num_cached_tokens: int = 0
    events: list[EngineCoreEvent] | None = None  # since the last output; only when the scheduler records them
    embedding: list[float] | None = None  # a pooling request's vector, in its finishing output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_request_ids: set[str] = field(default_factory=set)  # ended without an output of their own (aborts)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0  # the step's time, engine clock (unix seconds)
    kv_events: KVCacheEvents | None = None  # only when the engine records them
    errors: list[RequestError] = field(default_factory=list)  # requests the engine refused
    utility_result: UtilityResult | None = None
    engine_state: EngineState | None = None  # set when the engine's state changed
