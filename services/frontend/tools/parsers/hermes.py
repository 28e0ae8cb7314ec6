"""Hermes style (Qwen2.5/3, Hermes, the SmolLM2 tools template): each call in its own tag,
<tool_call>{"name": ..., "arguments": {...}}</tool_call>.
"""

from __future__ import annotations

from services.frontend.tools.parsers.json_scan import (
    CALL,
    PENDING,
    could_start,
    scan_call,
    skip_whitespace,
    text_before_tag,
)
from services.frontend.tools.parsers.tool_call import Scan
from services.frontend.tools.parsers.tool_parser import ToolParser

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """Text and tagged calls in any order; whitespace between calls (and after the last) is dropped."""

    name = "hermes"

    def scan(self, text: str, pos: int, final: bool) -> Scan:
        scan = Scan(stable_pos=pos)
        i = pos
        while True:
            tag = text_before_tag(scan, text, i, OPEN, final)
            if tag is None:
                return scan
            body = skip_whitespace(text, tag + len(OPEN))
            if body == len(text):
                if final:
                    scan.pieces.append(text[tag:])
                    scan.settle(len(text))
                return scan
            if text[body] != "{":  # a tag without JSON is text
                scan.pieces.append(text[tag:body])
                scan.settle(body)
                i = body
                continue
            found = scan_call(text, body, final, self.tool_names)
            if found.kind == PENDING:
                return scan
            if found.kind != CALL:
                scan.pieces.append(text[tag:found.end or len(text)])
                if found.end is None:
                    return scan
                scan.settle(found.end)
                i = found.end
                continue
            scan.pieces.append(found.call)
            if found.end is None:
                return scan
            resume = after = skip_whitespace(text, found.end)
            if text.startswith(CLOSE, after):
                resume = after + len(CLOSE)
                after = skip_whitespace(text, resume)
            elif could_start(text, after, CLOSE) and not final:
                return scan
            else:
                resume = found.end
            # Whitespace after a call is dropped when another call or the end follows, else it is text.
            if after == len(text) or could_start(text, after, OPEN):
                if not final:
                    return scan
                scan.settle(len(text))
                return scan
            i = after if text.startswith(OPEN, after) else resume
            scan.settle(i)
