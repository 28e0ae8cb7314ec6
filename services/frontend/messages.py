"""Plain dataclasses (the messages) that cross the frontend's boundaries (no protos, no gRPC).

EngineRequest goes to the engine client; EngineOutput comes back from it;
RequestOutput is what `AsyncLLM.generate()` yields.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# Shared with the engine core (one definition each, numbered like tandem.v1).
from engine_core.lora.info import LoraInfo
from engine_core.pooling_params import PoolingParams, PoolingType  # noqa: F401
from engine_core.sampling_params import FinishReason, SamplingParams, TokenLogprobs  # noqa: F401
from engine_core.types import KVCacheEvents, SchedulerStats  # noqa: F401


@dataclass(frozen=True)
class EngineInfo:
    """What an engine reported about its model in GetEngineInfo."""

    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()
    block_size: int = 0  # tokens per KV block: the prefix hashes' granularity (0: unknown)


@dataclass(frozen=True)
class EngineState:
    """What an engine does with new requests, as it last said (an engine that said nothing admits them)."""

    paused: bool = False  # held there until Resume
    pause_mode: str = ""  # abort | wait | keep, while paused
    asleep: bool = False  # refused until WakeUp
    lora_names: tuple[str, ...] = ()  # the LoRA adapters it has loaded

    @property
    def admitting(self) -> bool:
        return not self.paused and not self.asleep


@dataclass(frozen=True)
class EngineStatus:
    """One engine address as the engine client sees it."""

    address: str
    connected: bool
    num_in_flight: int
    state: EngineState = EngineState()


@dataclass(frozen=True)
class UtilityResult:
    """One engine's answer to a utility call (pause, sleep, ...)."""

    address: str
    ok: bool
    error: str = ""
    loras: tuple[LoraInfo, ...] = ()  # the LoRA calls' adapters
    error_kind: str = ""  # invalid_argument | not_found | failed_precondition, when the engine said


# ---- frontend -> engine -----------------------------------------------------------
@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # validated, defaults applied
    arrival_time: float
    priority: int = 0
    trace_headers: dict[str, str] = field(default_factory=dict)
    pooling: PoolingParams | None = None  # set: an embedding request (pooled, never sampled)
    lora_name: str | None = None  # the LoRA adapter to run it with (None: the base model)


# ---- engine -> frontend -----------------------------------------------------------
class EngineEventType(enum.IntEnum):
    """Scheduler events the engine reports (same numbers as tandem.v1.EngineCoreEventType)."""

    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


@dataclass(frozen=True)
class EngineEvent:
    type: EngineEventType
    timestamp: float  # engine clock, unix seconds


@dataclass
class EngineOutput:
    """One request's news from one engine step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    new_prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_cached_tokens: int = 0
    events: list[EngineEvent] = field(default_factory=list)  # since the request's last output
    timestamp: float = 0.0  # the engine step's time (engine clock)
    embedding: list[float] | None = None  # a pooling request's vector, when it finishes


@dataclass(frozen=True)
class RequestError:
    """An engine refused a request (its message says why)."""

    request_id: str
    message: str
    engine_asleep: bool = False  # refused for a state of the engine, not for anything in the request
    not_found: bool = False  # it names a LoRA adapter the engine has not loaded


@dataclass
class EngineMessage:
    """One message of an engine's stream: a step's outputs, refusals and maybe a utility call's answer."""

    outputs: list[EngineOutput] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    utility_call_id: int | None = None
    utility_ok: bool = False
    utility_error: str = ""
    utility_loras: tuple[LoraInfo, ...] = ()
    utility_error_kind: str = ""
    scheduler_stats: SchedulerStats | None = None
    kv_events: KVCacheEvents | None = None  # the engine's prefix-cache changes (for the router)
    engine_state: EngineState | None = None  # set when the engine's state changed


@dataclass
class EngineOutputs:
    """What an engine client hands AsyncLLM's output handler: one engine step, or requests that failed."""

    outputs: list[EngineOutput] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # engine request ids ended by `error`
    error: Exception | None = None


# ---- frontend -> caller -----------------------------------------------------------
@dataclass
class CompletionOutput:
    """One completion's progress: delta or cumulative, per the request's output kind."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None
    embedding: list[float] | None = None  # an embedding request's vector (its only message)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class RequestOutput:
    """One message of a request's stream; with n > 1 completions are told apart by index."""

    request_id: str
    completions: list[CompletionOutput]
    num_prompt_tokens: int = 0  # set in the first message
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # first message
    usage: Usage | None = None  # set in the last message
    finished: bool = False

    def merge(self, newer: RequestOutput, aggregate: bool) -> None:
        """Fold a newer message into this unsent one (for a consumer that fell behind).

        aggregate=True (DELTA) concatenates each completion's deltas; otherwise
        (CUMULATIVE, FINAL_ONLY) the newer completion replaces the older one.
        """
        by_index = {c.index: c for c in self.completions}
        for new in newer.completions:
            old = by_index.get(new.index)
            if old is None:
                self.completions.append(new)
                by_index[new.index] = new
            elif aggregate:
                old.text += new.text
                old.token_ids.extend(new.token_ids)
                old.logprobs.extend(new.logprobs)
                old.finish_reason, old.stop_string = new.finish_reason, new.stop_string
                old.stop_token_id = new.stop_token_id
            else:
                self.completions[self.completions.index(old)] = new
                by_index[new.index] = new
        self.num_prompt_tokens = self.num_prompt_tokens or newer.num_prompt_tokens
        self.prompt_logprobs = self.prompt_logprobs or newer.prompt_logprobs
        self.usage = newer.usage or self.usage
        self.finished = newer.finished


@dataclass
class EmbedResult:
    """What `AsyncLLM.embed()` returns: one vector per input, in input order."""

    request_id: str
    embeddings: list[list[float]]
    num_prompt_tokens: list[int]
    usage: Usage
