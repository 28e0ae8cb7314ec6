"""Tools in the Python client: tool definitions, tool_choice and history messages with calls, as protos;
streamed tool-call deltas and finished calls, as dataclasses. clients/generation.py uses these."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from tandem.v1 import generation_pb2

_MODES = {"auto": generation_pb2.TOOL_CHOICE_MODE_AUTO, "none": generation_pb2.TOOL_CHOICE_MODE_NONE,
          "required": generation_pb2.TOOL_CHOICE_MODE_REQUIRED}
TOOL_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls")


@dataclass(frozen=True)
class ToolCall:
    """A call in a completion's last message: arguments_json is a JSON object as text, or, when max_tokens cut
    the call (the completion's finish_reason is "length"), the unfinished text it got (`complete` is False)."""

    id: str
    index: int
    name: str
    arguments_json: str

    @property
    def arguments(self) -> dict | None:
        """The arguments as a dict; None for a cut call (its raw text stays in arguments_json)."""
        try:
            arguments = json.loads(self.arguments_json)
        except ValueError:
            return None
        return arguments if isinstance(arguments, dict) else None

    @property
    def complete(self) -> bool:
        """Whether the arguments are a whole JSON object: a cut call can be neither run nor sent back in the
        history (the server refuses history calls whose arguments are not an object)."""
        return self.arguments is not None


@dataclass(frozen=True)
class ToolCallDelta:
    """Streaming news of call `index`: id and name on its first delta, then argument fragments."""

    index: int
    arguments_json: str
    id: str | None = None
    name: str | None = None


def tool_calls_from_proto(chunk: generation_pb2.CompletionChunk) -> tuple[tuple, tuple]:
    """(deltas, calls) of one CompletionChunk."""
    deltas = tuple(ToolCallDelta(d.index, d.arguments_json, d.id or None, d.name or None)
                   for d in chunk.tool_call_deltas)
    calls = tuple(ToolCall(c.id, c.index, c.name, c.arguments_json) for c in chunk.tool_calls)
    return deltas, calls


def tools_to_proto(tools: Iterable) -> list[generation_pb2.Tool]:
    """Tools as dicts: {"name", "description", "parameters": schema dict or JSON text}, or OpenAI's
    {"type": "function", "function": {...}} around the same keys."""
    result = []
    for i, tool in enumerate(tools):
        if isinstance(tool, generation_pb2.Tool):
            result.append(tool)
            continue
        if not isinstance(tool, Mapping):
            raise TypeError(f"tools[{i}] must be a dict, got {type(tool).__name__}")
        spec = tool.get("function", tool)
        if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
            raise ValueError(f"tools[{i}] needs a 'name' (or a 'function' with one)")
        parameters = spec.get("parameters", "")
        result.append(generation_pb2.Tool(
            name=spec["name"], description=spec.get("description", ""),
            parameters_json=parameters if isinstance(parameters, str) else json.dumps(parameters)))
    return result


def tool_choice_to_proto(choice) -> generation_pb2.ToolChoice:
    """"auto" | "none" | "required", a function's name as {"name": ...} or OpenAI's
    {"type": "function", "function": {"name": ...}}."""
    if isinstance(choice, str):
        if choice not in _MODES:
            raise ValueError(f"tool_choice must be one of {', '.join(_MODES)} or {{'name': FUNCTION}}, got {choice!r}")
        return generation_pb2.ToolChoice(mode=_MODES[choice])
    if isinstance(choice, Mapping):
        name = choice.get("function", choice).get("name")
        if isinstance(name, str):
            return generation_pb2.ToolChoice(function_name=name)
    raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or {{'name': FUNCTION}}, got {choice!r}")


def tool_options_to_proto(request: generation_pb2.ChatRequest, tools=None, tool_choice=None,
                          parallel_tool_calls: bool | None = None) -> None:
    if tools is not None:
        request.tools.extend(tools_to_proto(tools))
    if tool_choice is not None:
        request.tool_choice.CopyFrom(tool_choice_to_proto(tool_choice))
    if parallel_tool_calls is not None:
        request.parallel_tool_calls = parallel_tool_calls


def history_calls_to_proto(calls: Iterable, where: str) -> list[generation_pb2.ToolCall]:
    """An assistant message's earlier calls: ToolCall objects, or dicts with id, name and arguments
    (a dict or JSON text), or OpenAI's {"id", "function": {"name", "arguments"}}."""
    result = []
    for j, call in enumerate(calls):
        if isinstance(call, ToolCall):
            result.append(generation_pb2.ToolCall(id=call.id, index=j, name=call.name,
                                                  arguments_json=call.arguments_json))
            continue
        if not isinstance(call, Mapping):
            raise TypeError(f"{where}.tool_calls[{j}] must be a dict or a ToolCall")
        spec = call.get("function", call)
        arguments = spec.get("arguments", spec.get("arguments_json", {}))
        result.append(generation_pb2.ToolCall(
            id=call.get("id", ""), index=j, name=spec.get("name", ""),
            arguments_json=arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return result
