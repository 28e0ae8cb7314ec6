"""Tool-call parsers: a completion's text -> plain text and typed tool calls, streamed as deltas.

One parser per model family, chosen from the chat template (`parser_for_template`) or by name
(the frontend's --tool-parser). `ToolCallStreamer` drives any of them chunk by chunk.
"""

from __future__ import annotations

from services.frontend.tools.parsers.forced import NamedFunctionParser, RequiredCallsParser
from services.frontend.tools.parsers.hermes import HermesToolParser
from services.frontend.tools.parsers.llama3_json import Llama3JsonToolParser
from services.frontend.tools.parsers.mistral import MistralToolParser
from services.frontend.tools.parsers.pythonic import PythonicToolParser
from services.frontend.tools.parsers.streamer import ToolCallStreamer
from services.frontend.tools.parsers.tool_call import ParsedDelta, ToolCall, ToolCallDelta
from services.frontend.tools.parsers.tool_parser import ToolParser

PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser
    for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)
}

# What a template writes into the prompt to show the model its call syntax, by parser (first match wins).
_TEMPLATE_MARKERS = (
    ("hermes", "<tool_call>"),
    ("mistral", "[TOOL_CALLS]"),
    ("pythonic", "[func_name1("),
    ("llama3_json", "<|python_tag|>"),
    ("llama3_json", '"parameters": '),
)


def parser_for_template(template: str | None) -> str | None:
    """The parser a chat template's call syntax needs, or None when it shows none."""
    return next((name for name, marker in _TEMPLATE_MARKERS if template and marker in template), None)


__all__ = [
    "PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "NamedFunctionParser",
    "PythonicToolParser", "ParsedDelta", "RequiredCallsParser", "ToolCall", "ToolCallDelta",
    "ToolCallStreamer", "ToolParser", "parser_for_template",
]
