"""What a caller of the frontend's AsyncLLM, the offline LLMEngine or LLM gets back: one message of a request's
stream, with one CompletionOutput per completion (n > 1 told apart by index).

The names are vLLM's (vllm/outputs.py): `RequestOutput.outputs`, `prompt`, `prompt_token_ids`, `finished`,
`metrics`; `CompletionOutput.text`, `token_ids`, `cumulative_logprob`, `logprobs`, `finish_reason`,
`stop_reason`. Tandem's own earlier name `completions` still works, as an alias of `outputs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.protocol.finish_reason import FinishReason
from engine_core.protocol.logprobs import TokenLogprobs


@dataclass
class CompletionOutput:
    """One completion's progress: delta or cumulative, per the request's output kind."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one entry per token when logprobs were asked
    finish_reason: FinishReason | None = None  # str() gives vLLM's "stop", "length", "abort"
    stop_string: str | None = None
    stop_token_id: int | None = None
    embedding: list[float] | None = None  # an embedding request's vector (its only message)
    # Chat with tools (the frontend's tool parsers, services/frontend/tools/parsers/; never the engine's):
    tool_call_deltas: list = field(default_factory=list)  # ToolCallDelta, in DELTA output
    tool_calls: list = field(default_factory=list)  # ToolCall: so far (CUMULATIVE) or all (the last message)
    # The sum of the sampled tokens' logprobs so far, whatever the output kind; None unless logprobs were asked
    cumulative_logprob: float | None = None

    @property
    def stop_reason(self) -> str | int | None:
        """vLLM's name: the stop string or stop token id that ended the completion (Tandem also names EOS's id,
        where vLLM gives None)."""
        return self.stop_string if self.stop_string is not None else self.stop_token_id

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class RequestMetrics:
    """A request's timestamps (time.time(), the producer's clock: the frontend's or the offline engine's)."""

    arrival_time: float
    first_token_ts: float = 0.0  # 0: no token yet
    last_token_ts: float = 0.0
    num_generation_tokens: int = 0  # every completion's, so far

    @property
    def first_token_latency(self) -> float | None:
        return self.first_token_ts - self.arrival_time if self.first_token_ts else None


@dataclass
class RequestOutput:
    """One message of a request's stream; with n > 1 completions are told apart by index."""

    request_id: str
    outputs: list[CompletionOutput]
    num_prompt_tokens: int = 0  # set in the first message
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # first message
    usage: Usage | None = None  # set in the last message
    finished: bool = False
    prompt: str | None = None  # the prompt's text, when it was given as text (or rendered from chat messages)
    prompt_token_ids: list[int] | None = None
    metrics: RequestMetrics | None = None

    @property
    def completions(self) -> list[CompletionOutput]:
        """Tandem's earlier name of `outputs`, kept as an alias."""
        return self.outputs

    @completions.setter
    def completions(self, value: list[CompletionOutput]) -> None:
        self.outputs = value

    @property
    def num_cached_tokens(self) -> int | None:
        """vLLM's name: prompt tokens found in the prefix cache (known in the last message)."""
        return None if self.usage is None else self.usage.cached_tokens

    def merge(self, newer: RequestOutput, aggregate: bool) -> None:
        """Fold a newer message into this unsent one (for a consumer that fell behind).

        aggregate=True (DELTA) concatenates each completion's deltas; otherwise
        (CUMULATIVE, FINAL_ONLY) the newer completion replaces the older one.
        """
        by_index = {c.index: c for c in self.outputs}
        for new in newer.outputs:
            old = by_index.get(new.index)
            if old is None:
                self.outputs.append(new)
                by_index[new.index] = new
            elif aggregate:
                old.text += new.text
                old.token_ids.extend(new.token_ids)
                old.logprobs.extend(new.logprobs)
                old.finish_reason, old.stop_string = new.finish_reason, new.stop_string
                old.stop_token_id = new.stop_token_id
                old.tool_call_deltas.extend(new.tool_call_deltas)
                old.tool_calls = new.tool_calls or old.tool_calls
                old.cumulative_logprob = new.cumulative_logprob
            else:
                self.outputs[self.outputs.index(old)] = new
                by_index[new.index] = new
        self.num_prompt_tokens = self.num_prompt_tokens or newer.num_prompt_tokens
        self.prompt_logprobs = self.prompt_logprobs or newer.prompt_logprobs
        self.prompt = self.prompt if self.prompt is not None else newer.prompt
        self.prompt_token_ids = self.prompt_token_ids if self.prompt_token_ids is not None else newer.prompt_token_ids
        self.usage = newer.usage or self.usage
        self.metrics = newer.metrics or self.metrics
        self.finished = newer.finished
