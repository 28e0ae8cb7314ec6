"""Input processing: a prompt (text, token ids or chat messages) -> a validated EngineCoreRequest."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace

from engine_core.protocol import EngineCoreRequest, OutputKind, PoolingParams, SamplingParams, validate_sampling_params
from services.frontend.chat.history import template_messages
from services.frontend.chat.template import ChatTemplateError, render_chat
from services.frontend.chat.template_choice import ChatSetup, choose_chat_setup
from services.frontend.errors import InvalidRequest
from services.frontend.limits import RequestLimits
from services.frontend.tokenizer import TokenizerBundle
from services.frontend.tools.request import ToolPlan, ToolRequest, plan_tools

CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ChatPrompt:
    """Chat messages to render with the model's own template (tool_calls / tool_call_id keys optional)."""

    messages: list[dict]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: ToolRequest | None = None


@dataclass
class TextPrompt:
    text: str
    add_special_tokens: bool = True


@dataclass
class TokensPrompt:
    token_ids: list[int] = field(default_factory=list)


Prompt = TextPrompt | TokensPrompt | ChatPrompt
# What AsyncLLM.generate takes, as vLLM's does: also a str, token ids, {"prompt": str} or {"prompt_token_ids": [...]}
PromptLike = Prompt | str | list[int] | dict


def as_prompt(prompt: PromptLike) -> Prompt:
    """The Prompt for what a caller passed; InvalidRequest naming what is accepted otherwise."""
    if isinstance(prompt, (TextPrompt, TokensPrompt, ChatPrompt)):
        return prompt
    if prompt is None:
        raise InvalidRequest("prompt is missing: set text or token_ids")
    if isinstance(prompt, str):
        return TextPrompt(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return TokensPrompt(prompt)
    if isinstance(prompt, dict) and set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
        return TextPrompt(prompt["prompt"])
    if isinstance(prompt, dict) and set(prompt) == {"prompt_token_ids"}:
        return as_prompt(list(prompt["prompt_token_ids"]))
    raise InvalidRequest(f"prompt is missing or not understood ({type(prompt).__name__}): pass a str, a list of "
                         "token ids, {\"prompt\": str}, {\"prompt_token_ids\": [...]}, or a TextPrompt, "
                         "TokensPrompt or ChatPrompt")


class InputProcessor:
    """Validates and tokenizes prompts against the model's limits (learned from the engine)."""

    def __init__(self, tokenizer: TokenizerBundle, *, limits: RequestLimits = RequestLimits(),
                 chat_setup: ChatSetup | None = None) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.chat_setup = chat_setup or choose_chat_setup(tokenizer.chat_template)  # template and tool parser
        self.max_model_len = 0  # 0: unknown until an engine reports it
        self.vocab_size = tokenizer.vocab_size

    def set_model_limits(self, max_model_len: int, vocab_size: int) -> None:
        """Called when an engine (re)connects and reports its model."""
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size or self.tokenizer.vocab_size

    # ---- the whole request ---------------------------------------------------------
    def process(self, request_id: str, prompt: Prompt, params: SamplingParams | None, *, priority: int = 0,
                trace_headers: dict[str, str] | None = None, pooling: PoolingParams | None = None,
                tool_plan: ToolPlan | None = None) -> EngineCoreRequest:
        """Validate and tokenize; fill in max_tokens when unset (the room left in the context, at most
        the server's --max-tokens). `pooling`: an embedding request, under the same prompt caps.
        `tool_plan` (from plan_tools): its constraint forces the tool_choice."""
        params = self.validate_sampling(params or SamplingParams())
        if params.output_kind is None:  # the wire's default, and AsyncLLM's
            params = replace(params, output_kind=OutputKind.DELTA)
        if tool_plan is not None:
            params = replace(params, structured=tool_plan.structured or params.structured,
                             skip_special_tokens=params.skip_special_tokens and not tool_plan.keep_special_tokens)
        token_ids = self.tokenize(prompt, tool_plan)
        room = self._check_length(len(token_ids), embedding=pooling is not None)
        if pooling is None:
            self._check_max_tokens(params, len(token_ids), room)
        if params.max_tokens is None and self.limits.max_tokens is not None:
            room = min(room, self.limits.max_tokens)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        params = replace(params, max_tokens=max_tokens, min_tokens=min(params.min_tokens, max_tokens))
        return EngineCoreRequest(
            request_id=request_id or new_request_id(), prompt_token_ids=token_ids, sampling_params=params,
            arrival_time=time.time(), priority=priority, trace_headers=dict(trace_headers or {}), pooling=pooling,
        )

    def validate_sampling(self, params: SamplingParams) -> SamplingParams:
        """The server's caps, then the one range check (token ids against the vocabulary)."""
        try:
            self.limits.check_sampling(params)
            return validate_sampling_params(params, vocab_size=self.vocab_size)
        except ValueError as e:
            raise InvalidRequest(f"sampling_params.{e}") from None

    def plan_tools(self, prompt: Prompt, params: SamplingParams | None) -> ToolPlan | None:
        """The plan for a chat prompt's tools (None: no tools); InvalidRequest naming the field."""
        if not isinstance(prompt, ChatPrompt):
            return None
        return plan_tools(prompt.tools, self.chat_setup, structured=params.structured if params else None,
                          max_calls=self.limits.max_tool_calls)

    # ---- prompts -> token ids ------------------------------------------------------
    def tokenize(self, prompt: Prompt, tool_plan: ToolPlan | None = None) -> list[int]:
        if isinstance(prompt, TokensPrompt):
            return self._check_token_ids(list(prompt.token_ids))
        if isinstance(prompt, ChatPrompt):
            return self.tokenizer.encode(self.render(prompt, tool_plan), add_special_tokens=False)
        if isinstance(prompt, TextPrompt):
            if not prompt.text:
                raise InvalidRequest("prompt text is empty; send some text, token_ids or chat messages")
            return self.tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        raise InvalidRequest("prompt is missing: set text or token_ids")

    def render(self, chat: ChatPrompt, tool_plan: ToolPlan | None = None) -> str:
        """The chat messages as prompt text, through the chat template (chat_setup: the model's own or the
        one that replaces it), with the tools of `tool_plan`."""
        template = self.chat_setup.template
        if not template:
            raise InvalidRequest("this model has no chat template; send a text prompt with Generate instead")
        if not chat.messages:
            raise InvalidRequest("messages is empty; send at least one chat message")
        for i, message in enumerate(chat.messages):
            if message["role"] not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, "
                                     f"got {message['role']!r}")
        if chat.continue_final_message and chat.add_generation_prompt:
            raise InvalidRequest("continue_final_message needs add_generation_prompt=false")
        tools = {"tools": tool_plan.template_tools} if tool_plan is not None else {}
        try:
            text = render_chat(template, template_messages(chat.messages),
                               add_generation_prompt=chat.add_generation_prompt,
                               bos_token=self.tokenizer.bos_token, eos_token=self.tokenizer.eos_token, **tools)
        except ChatTemplateError as e:
            raise InvalidRequest(f"messages: {e}") from e
        if chat.continue_final_message:  # cut what the template appends after the last message
            final = chat.messages[-1]["content"]
            end = text.rfind(final)
            text = text[:end + len(final)] if final and end >= 0 else text
        return text

    # ---- checks ---------------------------------------------------------------------
    def _check_token_ids(self, token_ids: list[int]) -> list[int]:
        if not token_ids:
            raise InvalidRequest("prompt token_ids is empty; send at least one token id")
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequest(f"prompt token_ids[{i}] = {token_id} is out of range: "
                                     f"the vocabulary has ids 0..{self.vocab_size - 1}")
        return token_ids

    def _check_length(self, num_tokens: int, *, embedding: bool = False) -> int:
        """The number of tokens left for generation; the prompt must leave at least one (the engine
        holds an embedding input to the same length)."""
        what = "input" if embedding else "prompt"
        if not num_tokens:
            raise InvalidRequest(f"{what} is empty after tokenization")
        cap = self.limits.max_prompt_tokens
        if cap is not None and num_tokens > cap:
            raise InvalidRequest(f"{what} is too long: {what} has {num_tokens} tokens, at most {cap} are allowed "
                                 "(the server's --max-prompt-tokens)")
        if self.max_model_len and num_tokens >= self.max_model_len:
            why = (f"an embedding input may have at most {self.max_model_len - 1} tokens" if embedding
                   else "leave room for at least one generated token")
            raise InvalidRequest(f"{what} is too long: {what} has {num_tokens} tokens, max_model_len is "
                                 f"{self.max_model_len} ({why})")
        return (self.max_model_len or 2**31 - 1) - num_tokens

    def _check_max_tokens(self, params: SamplingParams, num_prompt_tokens: int, room: int) -> None:
        """A max_tokens the context has no room for is refused, not silently cut, unless the request
        asks for that with clamp_max_tokens (as vLLM's and OpenAI's APIs refuse it)."""
        if not self.max_model_len or params.max_tokens is None or params.max_tokens <= room or params.clamp_max_tokens:
            return
        raise InvalidRequest(
            f"sampling_params.max_tokens is too large: this model's maximum context length is {self.max_model_len} "
            f"tokens and the prompt has {num_prompt_tokens}, so at most {room} can be generated; you requested "
            f"{params.max_tokens} ({num_prompt_tokens} + {params.max_tokens} > {self.max_model_len}). Lower "
            "max_tokens, leave it unset (up to the room left) or set sampling_params.clamp_max_tokens to cut it "
            "to the room left")


def new_request_id() -> str:
    return uuid.uuid4().hex
