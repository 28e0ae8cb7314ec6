"""The JSON schema that forces a tool_choice (vLLM's and smg's shape): required -> an array of calls, each
{"name": one tool's name, "parameters": that tool's arguments}; a named function -> its arguments alone."""

from __future__ import annotations


def required_calls_schema(tools: dict[str, dict], *, parallel: bool, max_calls: int) -> dict:
    """At least one call of the given tools (name -> parameters schema); at most one unless `parallel`, and
    never more than `max_calls` (a small model may otherwise append calls until max_tokens cuts one)."""
    calls = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for name, parameters in tools.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    schema["maxItems"] = max_calls if parallel else 1
    return schema
