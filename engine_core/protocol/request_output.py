"""What a caller of the frontend's AsyncLLM or the offline LLMEngine gets back: one message of a request's
stream, with one CompletionOutput per completion (n > 1 told apart by index)."""

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
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    stop_token_id: int | None = None
    embedding: list[float] | None = None  # an embedding request's vector (its only message)
    # Chat with tools (the frontend's tool parsers, services/frontend/tool_parsers/; never the engine's):
    tool_call_deltas: list = field(default_factory=list)  # ToolCallDelta, in DELTA output
    tool_calls: list = field(default_factory=list)  # ToolCall: so far (CUMULATIVE) or all (the last message)


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
                old.tool_call_deltas.extend(new.tool_call_deltas)
                old.tool_calls = new.tool_calls or old.tool_calls
            else:
                self.completions[self.completions.index(old)] = new
                by_index[new.index] = new
        self.num_prompt_tokens = self.num_prompt_tokens or newer.num_prompt_tokens
        self.prompt_logprobs = self.prompt_logprobs or newer.prompt_logprobs
        self.usage = newer.usage or self.usage
        self.finished = newer.finished
