"""Chat messages as chat templates expect them: an assistant's earlier tool calls with their arguments as
objects ({"id", "type": "function", "function": {"name", "arguments": {...}}}), a tool result's call id."""

from __future__ import annotations

import json

from services.frontend.errors import InvalidRequest


def template_messages(messages: list[dict]) -> list[dict]:
    """Copies of `messages` for the template: tool_calls' arguments_json decoded (InvalidRequest naming the
    field when it is not a JSON object); keys a message does not use are left out, as templates test them."""
    result = []
    for i, message in enumerate(messages):
        out = {"role": message["role"], "content": message["content"]}
        calls = message.get("tool_calls") or []
        if calls:
            out["tool_calls"] = [_call(call, f"messages[{i}].tool_calls[{j}]") for j, call in enumerate(calls)]
        if message.get("tool_call_id"):
            out["tool_call_id"] = message["tool_call_id"]
        result.append(out)
    return result


def _call(call: dict, where: str) -> dict:
    try:
        arguments = json.loads(call.get("arguments_json") or "{}")
    except ValueError as e:
        raise InvalidRequest(f"{where}.arguments_json is not JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.arguments_json must be a JSON object, got {type(arguments).__name__}")
    if not call.get("name"):
        raise InvalidRequest(f"{where}.name is empty")
    return {"id": call.get("id", ""), "type": "function", "function": {"name": call["name"], "arguments": arguments}}
