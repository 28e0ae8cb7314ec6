"""The output of a forced tool_choice: the structured-output constraint makes the model write bare JSON.

required: a JSON array of {"name": ..., "parameters": {...}} (tool_choice_schema.py builds the schema);
a named function: the arguments object alone, reported as one call to that function.
"""

from __future__ import annotations

from services.frontend.tools.parsers.call_list import scan_call_list
from services.frontend.tools.parsers.json_scan import json_end, skip_whitespace
from services.frontend.tools.parsers.tool_call import PartialCall, Scan
from services.frontend.tools.parsers.tool_parser import ToolParser


class RequiredCallsParser(ToolParser):
    """tool_choice required: the reply is an array of calls; anything else is text."""

    name = "required"

    def scan(self, text: str, pos: int, final: bool) -> Scan:
        scan = Scan(stable_pos=pos)
        if pos == 0:  # nothing settled yet: the array, or text
            start = skip_whitespace(text, 0)
            if start == len(text):
                if final:
                    scan.settle(len(text))
                return scan
            if text[start] == "[":
                end = scan_call_list(text, start + 1, final, self.tool_names, scan)
                if end is None:
                    return scan
                pos = end if scan.pieces else 0
        if pos < len(text):
            scan.pieces.append(text[pos:])
        scan.settle(len(text))
        return scan


class NamedFunctionParser(ToolParser):
    """tool_choice naming a function: the reply is that function's arguments object."""

    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__(frozenset([function_name]))
        self.function_name = function_name

    def scan(self, text: str, pos: int, final: bool) -> Scan:
        scan = Scan(stable_pos=pos)
        if pos:  # settled as text
            scan.pieces.append(text[pos:])
            scan.settle(len(text))
            return scan
        start = skip_whitespace(text, 0)
        if start == len(text):
            if final:
                scan.settle(len(text))
            return scan
        if text[start] != "{":  # not what the constraint allows: text
            scan.pieces.append(text[start:])
            scan.settle(len(text))
            return scan
        end = json_end(text, start)
        scan.pieces.append(PartialCall(self.function_name, text[start:end or len(text)], end is not None))
        if final:
            scan.settle(len(text))
        return scan
