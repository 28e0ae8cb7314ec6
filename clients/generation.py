"""tandem.v1.GenerationService's calls (and health) as the clients make them: typed requests built from keyword
arguments, typed results read from responses.

With admin.py, embeddings.py and tools.py, the only modules of the client library that touch generated proto
classes. Unknown keywords raise TypeError (with a suggestion), values of the wrong kind raise TypeError or
ValueError naming the parameter; the server still validates ranges (INVALID_ARGUMENT).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from grpc_health.v1 import health_pb2
from tandem.v1 import common_pb2, generation_pb2

from clients import tools

# Structured output as keywords (json_schema={...}, regex="...", choice=[...]): at most one constraint.
STRUCTURED_CONSTRAINTS = ("json_schema", "json_object", "regex", "choice", "grammar")
STRUCTURED_KEYWORDS = (*STRUCTURED_CONSTRAINTS, "whitespace_flexible")
SAMPLING_FIELDS = tuple(f.name for f in common_pb2.SamplingParams.DESCRIPTOR.fields) + STRUCTURED_KEYWORDS
_OUTPUT_KINDS = {"delta": common_pb2.OUTPUT_KIND_DELTA, "cumulative": common_pb2.OUTPUT_KIND_CUMULATIVE,
                 "final_only": common_pb2.OUTPUT_KIND_FINAL_ONLY}
_FINISH_REASONS = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
                   common_pb2.FINISH_REASON_ABORT: "abort", common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls"}
# What model_info() and server_info() return: the response messages as they come (read-only).
ModelInfo = generation_pb2.GetModelInfoResponse
ServerInfo = generation_pb2.GetServerInfoResponse
_GENERATE_OPTIONS = ("request_id", "priority", "add_special_tokens", "lora_name")
_CHAT_OPTIONS = ("request_id", "priority", "add_generation_prompt", "continue_final_message", "lora_name",
                 *tools.TOOL_OPTIONS)


# ---- results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache


@dataclass(frozen=True)
class Completion:
    """One completion's progress in one streamed message (a delta unless output_kind says otherwise)."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None while running, then "stop" | "length" | "abort" | "tool_calls"
    stop_string: str | None = None
    stop_token_id: int | None = None
    logprobs: tuple[dict[int, float], ...] = ()  # per token: token id -> logprob, chosen token first
    tool_call_deltas: tuple[tools.ToolCallDelta, ...] = ()  # chat with tools, delta output
    tool_calls: tuple[tools.ToolCall, ...] = ()  # chat with tools: all calls, in the completion's last message


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message: the completions that progressed, usage on the last one."""

    request_id: str
    completions: tuple[Completion, ...]
    usage: Usage | None
    num_prompt_tokens: int

    @property
    def text(self) -> str:
        return "".join(c.text for c in self.completions)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for c in self.completions for t in c.token_ids)

    @property
    def finish_reason(self) -> str | None:
        return next((c.finish_reason for c in self.completions if c.finish_reason), None)

    @property
    def tool_calls(self) -> tuple[tools.ToolCall, ...]:
        return tuple(call for c in self.completions for call in c.tool_calls)


@dataclass(frozen=True)
class Tokens:
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    max_model_len: int


def chunk_from_proto(response: generation_pb2.GenerateResponse | generation_pb2.ChatResponse) -> GenerateChunk:
    completions = tuple(
        Completion(
            index=c.index, text=c.text, token_ids=tuple(c.token_ids),
            finish_reason=_FINISH_REASONS.get(c.finish_reason),
            stop_string=c.stop_string if c.WhichOneof("stop_reason") == "stop_string" else None,
            stop_token_id=c.stop_token_id if c.WhichOneof("stop_reason") == "stop_token_id" else None,
            logprobs=tuple(dict(zip(lp.token_ids, lp.logprobs)) for lp in c.logprobs),
            **dict(zip(("tool_call_deltas", "tool_calls"), tools.tool_calls_from_proto(c))),
        )
        for c in response.completions
    )
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
    return GenerateChunk(response.request_id, completions, usage, response.num_prompt_tokens)


def tokens_from_proto(response: generation_pb2.TokenizeResponse) -> Tokens:
    return Tokens(tuple(response.token_ids), tuple(response.tokens), response.max_model_len)


# ---- requests --------------------------------------------------------------------------------------
def sampling_params(**sampling) -> common_pb2.SamplingParams:
    """SamplingParams from keywords (temperature=0, max_tokens=32, stop=["\\n"], output_kind="delta", ...)."""
    _reject_unknown(sampling, SAMPLING_FIELDS, "sampling parameter")
    sampling = {k: v for k, v in sampling.items() if v is not None}
    structured = {k: sampling.pop(k) for k in STRUCTURED_KEYWORDS if k in sampling}
    if structured:
        if "structured" in sampling:
            raise TypeError(f"give structured or the keywords {', '.join(structured)}, not both")
        sampling["structured"] = structured_output(**structured)
    if "output_kind" in sampling:
        sampling["output_kind"] = _output_kind(sampling["output_kind"])
    for name in ("stop", "stop_token_ids"):
        if isinstance(sampling.get(name), (str, int)):
            sampling[name] = [sampling[name]]
    try:
        return common_pb2.SamplingParams(**sampling)
    except (TypeError, ValueError) as e:
        raise TypeError(f"bad sampling parameter value: {e}") from None


def structured_output(*, json_schema: Mapping | str | None = None, json_object: bool | None = None,
                      regex: str | None = None, choice: Sequence[str] | None = None, grammar: str | None = None,
                      whitespace_flexible: bool | None = None) -> common_pb2.StructuredOutput:
    """A StructuredOutput with exactly one constraint: json_schema (a dict or JSON text), json_object=True,
    regex, choice (a list of strings) or grammar (Lark text). The server compiles it (INVALID_ARGUMENT if
    it does not compile)."""
    given = {name: value for name, value in (("json_schema", json_schema), ("json_object", json_object),
                                             ("regex", regex), ("choice", choice), ("grammar", grammar))
             if value is not None and value is not False}
    if len(given) != 1:
        raise ValueError(f"give exactly one of {', '.join(STRUCTURED_CONSTRAINTS)}, got "
                         f"{', '.join(given) or 'none'}")
    (kind, value), = given.items()
    proto = common_pb2.StructuredOutput(whitespace_flexible=bool(whitespace_flexible))
    if kind == "json_schema" and isinstance(value, Mapping):
        value = json.dumps(value)
    if kind == "choice":
        if isinstance(value, str) or not all(isinstance(option, str) for option in value):
            raise TypeError("choice must be a list of strings")
        proto.choice.options.extend(value)
    elif kind == "json_object":
        proto.json_object = True
    elif not isinstance(value, str):
        raise TypeError(f"{kind} must be a string{' or a dict' if kind == 'json_schema' else ''}, "
                        f"got {type(value).__name__}")
    else:
        setattr(proto, kind, value)
    return proto


def generate_request(prompt: str | Sequence[int], **kwargs) -> generation_pb2.GenerateRequest:
    """A GenerateRequest from a text prompt or a list of token ids plus sampling and request keywords."""
    options = {k: kwargs.pop(k) for k in _GENERATE_OPTIONS if kwargs.get(k) is not None}
    request = generation_pb2.GenerateRequest(sampling_params=_sampling_or_options(kwargs, _GENERATE_OPTIONS),
                                             **options)
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, Iterable) and not isinstance(prompt, (bytes, Mapping)):
        ids = list(prompt)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise TypeError("prompt must be a string or a sequence of int token ids")
        request.token_ids.ids.extend(ids)
    else:
        raise TypeError(f"prompt must be a string or a sequence of int token ids, got {type(prompt).__name__}")
    return request


def chat_request(messages: Iterable, **kwargs) -> generation_pb2.ChatRequest:
    """A ChatRequest from messages ({"role": ..., "content": ...} dicts or (role, content) pairs), with
    tools=[{"name", "description", "parameters"}], tool_choice="auto"|"none"|"required"|{"name": ...} and
    parallel_tool_calls (clients/tools.py)."""
    options = {k: kwargs.pop(k) for k in _CHAT_OPTIONS if kwargs.get(k) is not None}
    tool_options = {k: options.pop(k) for k in tools.TOOL_OPTIONS if k in options}
    request = generation_pb2.ChatRequest(messages=chat_messages(messages),
                                         sampling_params=_sampling_or_options(kwargs, _CHAT_OPTIONS), **options)
    tools.tool_options_to_proto(request, **tool_options)
    return request


def chat_messages(messages: Iterable) -> list[generation_pb2.ChatMessage]:
    result = []
    for i, message in enumerate(messages):
        if isinstance(message, generation_pb2.ChatMessage):
            result.append(message)
            continue
        calls, call_id = (), ""
        if isinstance(message, Mapping):
            extra = set(message) - {"role", "content", "tool_calls", "tool_call_id"}
            if extra or "role" not in message or "content" not in message:
                raise ValueError(f"messages[{i}] must have the keys 'role' and 'content' (and maybe 'tool_calls' "
                                 f"or 'tool_call_id'), got {sorted(message)}")
            role, content = message["role"], message["content"] or ""
            calls = tools.history_calls_to_proto(message.get("tool_calls") or (), f"messages[{i}]")
            call_id = message.get("tool_call_id") or ""
        elif isinstance(message, Sequence) and not isinstance(message, str) and len(message) == 2:
            role, content = message
        else:
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content' or a (role, content) pair")
        if not isinstance(role, str) or not isinstance(content, str):
            raise TypeError(f"messages[{i}]: role and content must be strings")
        result.append(generation_pb2.ChatMessage(role=role, content=content, tool_calls=calls, tool_call_id=call_id))
    return result


def tokenize_request(text: str | None = None, *, messages: Iterable | None = None,
                     add_special_tokens: bool | None = None, **chat_options) -> generation_pb2.TokenizeRequest:
    """Tokenize text, or chat messages as the chat template renders them (exactly one of the two)."""
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text or messages")
    _reject_unknown(chat_options, ("add_generation_prompt", "continue_final_message"), "tokenize option")
    request = generation_pb2.TokenizeRequest()
    if add_special_tokens is not None:
        request.add_special_tokens = add_special_tokens
    if text is not None:
        request.text = text
    else:
        request.chat.CopyFrom(generation_pb2.ChatRequest(
            messages=chat_messages(messages), **{k: v for k, v in chat_options.items() if v is not None}))
    return request


def detokenize_request(token_ids: Sequence[int], skip_special_tokens: bool | None) -> generation_pb2.DetokenizeRequest:
    request = generation_pb2.DetokenizeRequest(token_ids=list(token_ids))
    if skip_special_tokens is not None:
        request.skip_special_tokens = skip_special_tokens
    return request


def abort_request(request_ids: Sequence[str]) -> generation_pb2.AbortRequest:
    return generation_pb2.AbortRequest(request_ids=list(request_ids))


def model_info_request() -> generation_pb2.GetModelInfoRequest:
    return generation_pb2.GetModelInfoRequest()


def server_info_request() -> generation_pb2.GetServerInfoRequest:
    return generation_pb2.GetServerInfoRequest()


def health_request(service: str) -> health_pb2.HealthCheckRequest:
    return health_pb2.HealthCheckRequest(service=service)


def health_status(reply: health_pb2.HealthCheckResponse) -> str:
    """The grpc.health.v1 status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN."""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


# ---- helpers ---------------------------------------------------------------------------------------
def _sampling_or_options(kwargs: dict, options: tuple[str, ...]) -> common_pb2.SamplingParams:
    unknown = [k for k in kwargs if k not in SAMPLING_FIELDS]
    if unknown:
        _reject_unknown({k: None for k in unknown}, SAMPLING_FIELDS + options, "keyword argument")
    return sampling_params(**kwargs)


def _reject_unknown(given: Mapping, known: Sequence[str], what: str) -> None:
    for name in given:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"
            raise TypeError(f"unknown {what} {name!r}{hint}")


def _output_kind(value) -> int:
    if isinstance(value, str):
        try:
            return _OUTPUT_KINDS[value.lower()]
        except KeyError:
            raise ValueError(f"output_kind must be one of {', '.join(_OUTPUT_KINDS)}, got {value!r}") from None
    return int(value)
