"""Pythonic style (Llama 3.2/4, ToolACE): the reply is a Python list of calls, [f(a=1), g(b="x")].

Each call is reported once its closing parenthesis arrives, with its keyword arguments (Python literals)
as a JSON object. A reply that starts any other way, or a call that is not literal keywords, is text.
"""

from __future__ import annotations

import ast
import json
import re

from services.frontend.tools.parsers.json_scan import skip_whitespace
from services.frontend.tools.parsers.tool_call import PartialCall, Scan
from services.frontend.tools.parsers.tool_parser import ToolParser

_CALL_START = re.compile(r"[A-Za-z_][\w.-]*\s*\(")
_NAME_CHARS = re.compile(r"[\w.\s-]*")
_BRACKETS = re.compile(r"""[()\[\]{}'"\\]""")


def _call_end(text: str, i: int) -> int | None:
    """The index past the parenthesis that closes the call opened at text[i] ("name("), or None."""
    depth, quote, escaped_at = 0, "", -1
    for match in _BRACKETS.finditer(text, text.index("(", i)):
        if match.start() == escaped_at:  # the character after a backslash
            continue
        c = match.group()
        if c == "\\":
            escaped_at = match.end()
        elif quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return match.end()
    return None


def _decode_call(source: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of `name(key=literal, ...)`, or None."""
    try:
        node = ast.parse(source, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        if None in arguments:  # **kwargs
            return None
        return name, json.dumps(arguments, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        super().__init__(tool_names)
        self.calls_mode: bool | None = None  # decided by the first non-space character
        self.list_start = 0  # where "[" is: text from there if the list holds no call
        self.num_calls = 0

    def scan(self, text: str, pos: int, final: bool) -> Scan:
        scan = Scan(stable_pos=pos)
        i = pos
        if self.calls_mode is None:
            start = skip_whitespace(text, i)
            if start == len(text):
                if final:
                    scan.pieces.append(text[i:])
                    scan.settle(len(text))
                return scan
            self.calls_mode = text[start] == "["
            if self.calls_mode:
                self.list_start, i = start, start + 1
                scan.settle(i)
        in_list = self.calls_mode
        while self.calls_mode:
            i = skip_whitespace(text, i)
            if i == len(text):
                if final:
                    scan.settle(i)
                return scan
            if text[i] == "]":
                self.calls_mode = False
                i += 1
                scan.settle(i)
                break
            head = _CALL_START.match(text, i)
            if head is None:
                if _NAME_CHARS.match(text, i).end() == len(text) and not final:
                    return scan  # maybe a name still being written
                self.calls_mode = False
                break
            end = _call_end(text, i)
            if end is None:
                if not final:
                    return scan
                self.calls_mode = False
                break
            decoded = _decode_call(text[i:end])
            if decoded is None or (self.tool_names is not None and decoded[0] not in self.tool_names):
                self.calls_mode = False
                break
            scan.pieces.append(PartialCall(*decoded, complete=True))
            self.num_calls += 1
            i = skip_whitespace(text, end)
            if i == len(text) and not final:
                return scan
            if i < len(text) and text[i] == ",":
                i += 1
            elif i < len(text) and text[i] != "]":
                self.calls_mode = False
                i = end
            scan.settle(i)
        if in_list and not self.num_calls:  # a list without calls is text, "[" and all
            i = self.list_start
        if i < len(text):
            scan.pieces.append(text[i:])
        scan.settle(len(text))
        return scan
