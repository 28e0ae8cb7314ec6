"""A JSON array of call objects, read incrementally: [{"name": ..., "arguments": {...}}, ...]."""

from __future__ import annotations

from services.frontend.tools.parsers.json_scan import CALL, PENDING, scan_call, skip_whitespace
from services.frontend.tools.parsers.tool_call import Scan


def scan_call_list(text: str, i: int, final: bool, names: frozenset[str] | None, scan: Scan) -> int | None:
    """Append the calls of the array whose "[" was just before text[i] to `scan`.

    An element that is not a call (or calls a tool not offered) is text, as the model wrote it.
    Returns the index past its "]" (or where the array stopped being one; what follows is text), or None
    while the array is still open (nothing after it is settled).
    """
    while True:
        i = skip_whitespace(text, i)
        if i == len(text):
            return i if final else None
        if text[i] == "]":
            return i + 1
        if text[i] != "{":
            return i
        found = scan_call(text, i, final, names)
        if found.kind == PENDING:
            return None
        scan.pieces.append(found.call if found.kind == CALL else text[i:found.end or len(text)])
        if found.end is None:
            return None
        i = skip_whitespace(text, found.end)
        if i == len(text):
            return i if final else None
        if text[i] == ",":
            i += 1
