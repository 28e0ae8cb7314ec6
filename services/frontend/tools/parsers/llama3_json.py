"""Llama 3.x JSON style: the reply is {"name": ..., "parameters": {...}} objects separated by ";",
optionally after <|python_tag|>; a reply that starts any other way is plain text."""

from __future__ import annotations

from services.frontend.tools.parsers.json_scan import CALL, PENDING, could_start, scan_call, skip_whitespace
from services.frontend.tools.parsers.tool_call import Scan
from services.frontend.tools.parsers.tool_parser import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        super().__init__(tool_names)
        self.calls_mode: bool | None = None  # None until the first non-space characters decide

    def scan(self, text: str, pos: int, final: bool) -> Scan:
        scan = Scan(stable_pos=pos)
        i = pos
        if self.calls_mode is None:
            start = skip_whitespace(text, i)
            if start == len(text) or could_start(text, start, PYTHON_TAG):
                if final:
                    scan.pieces.append(text[i:])
                    scan.settle(len(text))
                return scan
            self.calls_mode = text.startswith(PYTHON_TAG, start) or text[start] == "{"
            if self.calls_mode:  # leading whitespace and the tag are not text
                i = start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start
                scan.settle(i)
        while self.calls_mode:
            i = skip_whitespace(text, i)
            if i == len(text):
                if final:
                    scan.settle(i)
                return scan
            if text[i] != "{":
                self.calls_mode = False
                break
            found = scan_call(text, i, final, self.tool_names)
            if found.kind == PENDING:
                return scan
            if found.kind != CALL:
                self.calls_mode = False
                break
            scan.pieces.append(found.call)
            if found.end is None:
                return scan
            after = skip_whitespace(text, found.end)
            if after == len(text) and not final:
                return scan
            if after < len(text) and text[after] == ";":
                after += 1
            elif after < len(text):  # something other than another call: the rest is text
                self.calls_mode = False
                i = found.end
                scan.settle(i)
                break
            i = after
            scan.settle(i)
        if i < len(text):
            scan.pieces.append(text[i:])
        scan.settle(len(text))
        return scan
