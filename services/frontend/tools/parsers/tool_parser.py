"""The interface every tool-call parser implements."""

from __future__ import annotations

from services.frontend.tools.parsers.tool_call import Scan


class ToolParser:
    """Reads one completion's text into plain text and tool calls, one parser object per completion.

    `scan(text, pos, final)` reads text[pos:] (text only ever grows; pos is the previous scan's stable_pos).
    Its reading must only grow as text grows: text pieces get longer or are followed by more, calls get
    more arguments or are followed by more. Until the text ends (final), anything that may still turn out
    to be a tag or a call is held back, never reported as text.
    """

    name = ""
    # The model writes its call marker as a special token that skip_special_tokens would drop.
    needs_special_tokens = False

    def __init__(self, tool_names: frozenset[str] | None = None) -> None:
        self.tool_names = tool_names  # the offered tools; a call to any other name is text (None: any)

    def scan(self, text: str, pos: int, final: bool) -> Scan:
        raise NotImplementedError
