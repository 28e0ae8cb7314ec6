"""Incremental reading of JSON tool calls ({"name": ..., "arguments": {...}}) in a growing text.

A call in the streamable layout (name first, then an object of arguments) is reported as soon as its
arguments object opens, and its arguments grow with the raw text the model wrote; any other layout waits
until the object closes and is then decoded whole (arguments given as a JSON string are decoded to the
object). What is not a call, or names a tool the request did not offer, is plain text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from services.frontend.tools.parsers.tool_call import PartialCall, Scan

_STRUCTURE = re.compile(r'[{}\[\]"\\]')
_WHITESPACE = re.compile(r"\s*")
ARGUMENT_KEYS = ("arguments", "parameters")


def skip_whitespace(text: str, i: int) -> int:
    return _WHITESPACE.match(text, i).end()


def json_end(text: str, i: int) -> int | None:
    """The index just past the JSON object or array that opens at text[i], or None if it has not closed."""
    depth, in_string, escaped_at = 0, False, -1
    for match in _STRUCTURE.finditer(text, i):
        if match.start() == escaped_at:  # the character after a backslash
            continue
        c = match.group()
        if c == "\\":
            escaped_at = match.end()
        elif in_string:
            in_string = c != '"'
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return match.end()
    return None


def held_tag_prefix(text: str, start: int, tag: str) -> int:
    """How many characters at the end of text[start:] could begin `tag` (held back, never sent as text)."""
    for size in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def text_before_tag(scan: Scan, text: str, start: int, tag: str, final: bool) -> int | None:
    """Take the plain text from `start` up to the next `tag` into `scan` and return the tag's position; None when no
    tag follows (the text is taken and settled, but for an end that could begin the tag, held back unless final)."""
    found = text.find(tag, start)
    if found < 0:
        end = len(text) - (0 if final else held_tag_prefix(text, start, tag))
        if end > start:
            scan.pieces.append(text[start:end])
        scan.settle(end)
        return None
    if found > start:
        scan.pieces.append(text[start:found])
        scan.settle(found)
    return found


def could_start(text: str, i: int, tag: str) -> bool:
    """text[i:] is a proper beginning of `tag` (the rest may still come)."""
    return len(text) - i < len(tag) and tag.startswith(text[i:])


# ---- the head of a streamable call: {"name": "...", "arguments": { ---------------------------------------
_MATCH, _PARTIAL, _NO = "match", "partial", "no"


def _read_string(text: str, i: int) -> tuple[str, int | str]:
    """A JSON string literal at text[i]: (_MATCH, end) | (_PARTIAL, "") | (_NO, "")."""
    if i >= len(text):
        return _PARTIAL, ""
    if text[i] != '"':
        return _NO, ""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            return _MATCH, j + 1
        j += 1
    return _PARTIAL, ""


def _decode_string(literal: str) -> str | None:
    try:
        return json.loads(literal)
    except ValueError:  # a control character or a bad escape in it
        return None


def _expect(text: str, i: int, char: str) -> tuple[str, int]:
    i = skip_whitespace(text, i)
    if i >= len(text):
        return _PARTIAL, i
    return (_MATCH, i + 1) if text[i] == char else (_NO, i)


def _expect_key(text: str, i: int, keys: tuple[str, ...]) -> tuple[str, int]:
    i = skip_whitespace(text, i)
    status, end = _read_string(text, i)
    if status == _PARTIAL:
        return (_PARTIAL, i) if any(f'"{key}"'.startswith(text[i:]) for key in keys) else (_NO, i)
    if status == _NO or _decode_string(text[i:end]) not in keys:
        return _NO, i
    return _MATCH, end


def streamable_head(text: str, i: int) -> tuple[str, str, int]:
    """Read `{"name": "NAME", "arguments": {` at text[i] ("parameters" is taken for "arguments").

    (_MATCH, NAME, index of the arguments' "{"), (_PARTIAL, "", 0) when the text ends inside it,
    (_NO, "", 0) when this object has another layout.
    """
    status, j = _expect(text, i, "{")
    if status != _MATCH:
        return status, "", 0
    status, j = _expect_key(text, j, ("name",))
    if status != _MATCH:
        return status, "", 0
    status, j = _expect(text, j, ":")
    if status != _MATCH:
        return status, "", 0
    j = skip_whitespace(text, j)
    status, end = _read_string(text, j)
    if status != _MATCH:
        return status, "", 0
    name = _decode_string(text[j:end])
    if name is None:
        return _NO, "", 0
    for step in (",", ARGUMENT_KEYS, ":", "{"):
        status, end = _expect_key(text, end, step) if isinstance(step, tuple) else _expect(text, end, step)
        if status != _MATCH:
            return status, "", 0
    return _MATCH, name, end - 1


# ---- one call -------------------------------------------------------------------------------------------
PENDING, CALL, TEXT = "pending", "call", "text"


@dataclass
class CallScan:
    """What the object at a position is so far. kind PENDING: undecided (hold it back); CALL: `call`;
    TEXT: not a call, plain text up to `end`. `end`: past the object, None while it is open."""

    kind: str
    end: int | None = None
    call: PartialCall | None = None


def decode_call(obj) -> tuple[str, str] | None:
    """(name, arguments as JSON object text) of a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in ARGUMENT_KEYS if k in obj), None)
    arguments = obj[key] if key else {}
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def scan_call(text: str, i: int, final: bool, names: frozenset[str] | None) -> CallScan:
    """The JSON object opening at text[i] as a tool call (names: the offered tools; None: any name)."""
    end = json_end(text, i)
    status, name, args_start = streamable_head(text, i)
    if status == _MATCH:
        if names is not None and name not in names:
            return CallScan(TEXT, end)
        args_end = json_end(text, args_start)
        arguments = text[args_start:args_end or len(text)]
        complete = args_end is not None and end is not None
        return CallScan(CALL, end if end is not None or not final else len(text),
                        PartialCall(name, arguments, complete))
    if end is None:
        return CallScan(TEXT, len(text)) if final else CallScan(PENDING)
    if status == _PARTIAL:  # cannot be: a closed object has a decided head
        return CallScan(TEXT, end)
    try:
        decoded = decode_call(json.loads(text[i:end]))
    except ValueError:
        decoded = None
    if decoded is None or (names is not None and decoded[0] not in names):
        return CallScan(TEXT, end)
    return CallScan(CALL, end, PartialCall(*decoded, complete=True))
