"""Tool fields between tandem.v1 protos and the frontend's dataclasses (services/frontend/convert.py calls these)."""

from __future__ import annotations

from tandem.v1 import generation_pb2

from engine_core.protocol import CompletionOutput
from services.frontend.tools.request import AUTO, FUNCTION, NONE, REQUIRED, ToolRequest, ToolSpec

_MODES = {generation_pb2.TOOL_CHOICE_MODE_UNSPECIFIED: AUTO, generation_pb2.TOOL_CHOICE_MODE_AUTO: AUTO,
          generation_pb2.TOOL_CHOICE_MODE_NONE: NONE, generation_pb2.TOOL_CHOICE_MODE_REQUIRED: REQUIRED}


def message_from_proto(message: generation_pb2.ChatMessage) -> dict:
    """A chat message as a dict; tool_calls and tool_call_id only when set (validated when rendered)."""
    result = {"role": message.role, "content": message.content}
    if message.tool_calls:
        result["tool_calls"] = [{"id": c.id, "name": c.name, "arguments_json": c.arguments_json}
                                for c in message.tool_calls]
    if message.tool_call_id:
        result["tool_call_id"] = message.tool_call_id
    return result


def tool_request_from_proto(request: generation_pb2.ChatRequest) -> ToolRequest | None:
    """tools, tool_choice, parallel_tool_calls (None: none of them set). An unknown mode is kept as its
    number, for plan_tools to refuse."""
    if not request.tools and not request.HasField("tool_choice"):
        return None
    choice, function_name = AUTO, ""
    which = request.tool_choice.WhichOneof("choice")
    if which == "function_name":
        choice, function_name = FUNCTION, request.tool_choice.function_name
    elif which == "mode":
        choice = _MODES.get(request.tool_choice.mode, f"mode {request.tool_choice.mode}")
    return ToolRequest(
        tools=tuple(ToolSpec(t.name, t.description, t.parameters_json) for t in request.tools),
        choice=choice, function_name=function_name,
        parallel=request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True,
    )


def add_tool_calls(chunk: generation_pb2.CompletionChunk, completion: CompletionOutput) -> None:
    """A completion's tool-call deltas and calls (its finish reason, TOOL_CALLS after calls, is the
    output processor's: tool_output.py)."""
    for d in completion.tool_call_deltas:
        chunk.tool_call_deltas.add(index=d.index, id=d.id or "", name=d.name or "", arguments_json=d.arguments)
    for c in completion.tool_calls:
        chunk.tool_calls.add(id=c.id, index=c.index, name=c.name, arguments_json=c.arguments_json)
