"""Plain dataclasses (the messages) that cross the frontend's boundaries (no protos, no gRPC).

EngineRequest goes to the engine client; EngineOutput comes back from it;
RequestOutput is what `AsyncLLM.generate()` yields.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from services.frontend.sampling import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a completion stopped (same numbers as tandem.v1.FinishReason)."""

    STOP = 1  # EOS, a stop token id or a stop string
    LENGTH = 2  # max_tokens or the context length
    ABORT = 3  # cancelled by the client, the server or a shutdown


@dataclass(frozen=True)
class EngineInfo:
    """What an engine reported about its model in GetEngineInfo."""

    model_name: str
    model_path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class TokenLogprobs:
    """Logprobs at one position: index 0 is the chosen token, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int
    decoded: list[str] = field(default_factory=list)


# ---- frontend -> engine -----------------------------------------------------------
@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams  # validated, defaults applied
    arrival_time: float
    priority: int = 0
    trace_headers: dict[str, str] = field(default_factory=dict)


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
