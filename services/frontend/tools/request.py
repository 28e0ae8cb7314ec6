"""A Chat request's tools: what the client sent, checked, and the plan the frontend follows for it.

`plan_tools` turns a ToolRequest into a ToolPlan before anything reaches the engine: the tools as the
chat template wants them, the structured-output constraint that forces a tool_choice, and the parser
that reads the calls out of each completion. Every problem is an InvalidRequest naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import jsonschema

from engine_core.protocol import StructuredOutput
from engine_core.protocol.structured_output import check_structured_output
from services.frontend.chat.template_choice import ChatSetup
from services.frontend.errors import InvalidRequest
from services.frontend.limits import DEFAULT_MAX_TOOL_CALLS
from services.frontend.tools.choice_schema import required_calls_schema
from services.frontend.tools.parsers import PARSERS, NamedFunctionParser, RequiredCallsParser, ToolParser

TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
NONE, AUTO, REQUIRED, FUNCTION = "none", "auto", "required", "function"


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the client sent it."""

    name: str
    description: str = ""
    parameters_json: str = ""  # a JSON schema as text; empty: no arguments


@dataclass(frozen=True)
class ToolRequest:
    """tools, tool_choice and parallel_tool_calls of a Chat request (choice: none | auto | required |
    function, with function_name for the last)."""

    tools: tuple[ToolSpec, ...] = ()
    choice: str = AUTO
    function_name: str = ""
    parallel: bool = True


@dataclass(frozen=True)
class ToolPlan:
    """What the frontend does for a request with tools."""

    template_tools: list[dict]  # for the chat template: [{"type": "function", "function": {...}}]
    parser_name: str  # a key of PARSERS, or "required" / "named" for a forced choice
    tool_names: frozenset[str]
    structured: StructuredOutput | None = None  # forces tool_choice required / a named function
    function_name: str = ""
    keep_special_tokens: bool = False  # the parser's call marker is a special token
    schemas: dict[str, dict] = field(default_factory=dict)  # name -> parameters schema

    def new_parser(self) -> ToolParser:
        """A fresh parser for one completion."""
        if self.parser_name == "required":
            return RequiredCallsParser(self.tool_names)
        if self.parser_name == "named":
            return NamedFunctionParser(self.function_name)
        return PARSERS[self.parser_name](self.tool_names)


def plan_tools(request: ToolRequest | None, setup: ChatSetup, *, structured: StructuredOutput | None,
               max_calls: int = DEFAULT_MAX_TOOL_CALLS) -> ToolPlan | None:
    """The plan for a request's tools (None: no tools, or tool_choice none). `structured`: the request's own
    sampling_params.structured, which a forced tool_choice cannot be combined with; `max_calls`: the most
    calls tool_choice required may force (the server's --max-tool-calls)."""
    if request is None or request.choice == NONE:
        return None
    if request.choice not in (AUTO, REQUIRED, FUNCTION):
        raise InvalidRequest(f"tool_choice.{request.choice} is not a ToolChoiceMode (NONE, AUTO or REQUIRED)")
    if not request.tools:
        if request.choice in (REQUIRED, FUNCTION):
            raise InvalidRequest(f"tool_choice is {request.choice!r} but tools is empty; send the tools to call")
        return None
    schemas = _check_tools(request.tools)
    if not setup.renders_tools:
        raise InvalidRequest("tools: this model's chat template has no tools branch, so it cannot show the model "
                             "its tools; start the frontend with --chat-template FILE (a template that renders "
                             "`tools`)")
    template_tools = [{"type": "function", "function": {
        "name": t.name, "description": t.description, "parameters": schemas[t.name]}} for t in request.tools]
    names = frozenset(schemas)
    if request.choice in (REQUIRED, FUNCTION):
        if structured is not None:
            raise InvalidRequest(f"sampling_params.structured cannot be combined with tool_choice "
                                 f"{request.choice!r}: the tool call's schema is the constraint")
        if request.choice == FUNCTION:
            if request.function_name not in schemas:
                raise InvalidRequest(f"tool_choice.function_name {request.function_name!r} is not one of the "
                                     f"tools ({', '.join(sorted(schemas))})")
            schema = schemas[request.function_name]
            parser = "named"
        else:
            schema = required_calls_schema(schemas, parallel=request.parallel, max_calls=max_calls)
            parser = "required"
        return ToolPlan(template_tools, parser, names, StructuredOutput(json_schema=json.dumps(schema)),
                        function_name=request.function_name, schemas=schemas)
    if setup.tool_parser is None:
        raise InvalidRequest("tools: no tool-call parser fits this model's chat template; start the frontend with "
                             f"--tool-parser ({', '.join(sorted(PARSERS))}) or use tool_choice required")
    return ToolPlan(template_tools, setup.tool_parser, names,
                    keep_special_tokens=PARSERS[setup.tool_parser].needs_special_tokens, schemas=schemas)


def _check_tools(tools: tuple[ToolSpec, ...]) -> dict[str, dict]:
    """name -> parameters schema, each checked: a valid name, unique, a JSON Schema that llguidance compiles."""
    schemas: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        if not TOOL_NAME.fullmatch(tool.name):
            raise InvalidRequest(f"tools[{i}].name {tool.name!r} must be 1 to 64 letters, digits, '_', '.' or '-'")
        if tool.name in schemas:
            raise InvalidRequest(f"tools[{i}].name {tool.name!r} is given twice; tool names must be unique")
        schemas[tool.name] = _parameters_schema(tool.parameters_json, f"tools[{i}].parameters_json")
    return schemas


def _parameters_schema(text: str, where: str) -> dict:
    if not text.strip():
        return {"type": "object"}
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"{where} is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{where} must be a JSON Schema object, got {type(schema).__name__}")
    if schema.get("type", "object") != "object":
        raise InvalidRequest(f"{where} must describe an object (\"type\": \"object\"), got {schema.get('type')!r}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise InvalidRequest(f"{where} is not a valid JSON Schema: {e.message}") from None
    try:
        check_structured_output(StructuredOutput(json_schema=json.dumps(schema)))
    except ValueError as e:
        raise InvalidRequest(f"{where} cannot be used as a constraint: {e}") from None
    return schema
