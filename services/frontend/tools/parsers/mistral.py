"""Mistral style: text, then [TOOL_CALLS] and a JSON array of {"name": ..., "arguments": {...}} objects."""

from __future__ import annotations

from services.frontend.tools.parsers.call_list import scan_call_list
from services.frontend.tools.parsers.json_scan import skip_whitespace, text_before_tag
from services.frontend.tools.parsers.tool_call import Scan
from services.frontend.tools.parsers.tool_parser import ToolParser

TAG = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    """[TOOL_CALLS] is a control token: requests with tools keep special tokens in the text (vLLM does the
    same). A single object after the tag is taken as a one-call array."""

    name = "mistral"
    needs_special_tokens = True

    def scan(self, text: str, pos: int, final: bool) -> Scan:
        scan = Scan(stable_pos=pos)
        i = pos
        while True:
            tag = text_before_tag(scan, text, i, TAG, final)
            if tag is None:
                return scan
            body = skip_whitespace(text, tag + len(TAG))
            if body == len(text) and not final:
                return scan
            end = body
            if body < len(text) and text[body] in "[{":
                num_pieces = len(scan.pieces)
                start = body + 1 if text[body] == "[" else body
                end = scan_call_list(text, start, final, self.tool_names, scan)
                if end is None:
                    return scan
                if len(scan.pieces) == num_pieces:  # not a single element read: the tag is text
                    end = body
            if end == body:
                scan.pieces.append(text[tag:body])
            scan.settle(end)
            i = end
