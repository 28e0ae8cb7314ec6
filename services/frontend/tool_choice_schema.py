"""The JSON schema that forces a tool_choice (vLLM's and smg's shape): required -> an array of calls, each
{"name": one tool's name, "parameters": that tool's arguments}; a named function -> its arguments alone."""

from __future__ import annotations


def required_calls_schema(tools: dict[str, dict], *, parallel: bool) -> dict:
    """At least one call of the given tools (name -> parameters schema); at most one unless `parallel`."""
    calls = [{
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [name]}, "parameters": parameters},
        "required": ["name", "parameters"],
        "additionalProperties": False,
    } for name, parameters in tools.items()]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
