"""Streams one completion's text through a tool parser as plain-text and tool-call deltas."""

from __future__ import annotations

import uuid

from services.frontend.tools.parsers.tool_call import ParsedDelta, PartialCall, ToolCall, ToolCallDelta
from services.frontend.tools.parsers.tool_parser import ToolParser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStreamer:
    """Feed the completion's text chunk by chunk; each feed returns what is new. Whatever the chunking, the
    concatenated deltas equal one feed of the whole text (the conformance tests check this)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.pos = 0  # the parser's next scan starts here: what lies before is settled
        self.settled_text = ""  # plain text of the settled pieces
        self.settled_calls: list[PartialCall] = []
        self.text = ""  # plain text sent so far
        self.calls: list[PartialCall] = []  # calls as far as sent
        self.ids: list[str] = []
        self.finished = False

    def feed(self, chunk: str, final: bool = False) -> ParsedDelta:
        """The plain text and tool-call news that `chunk` adds; final: the completion ended (flush)."""
        self.buffer += chunk
        self.finished = final
        scan = self.parser.scan(self.buffer, self.pos, final)
        texts = [p for p in scan.pieces if isinstance(p, str)]
        calls = self.settled_calls + [p for p in scan.pieces if isinstance(p, PartialCall)]
        delta = ParsedDelta()
        # Plain text: what the current reading has beyond what was sent.
        offset = len(self.text) - len(self.settled_text)
        new_text = "".join(texts)[offset:]
        if new_text:
            delta.text = new_text
            self.text += new_text
        # Calls: a new one is sent with its id and name; after that, the arguments' new tail.
        for index, call in enumerate(calls):
            if index == len(self.calls):
                self.ids.append(new_call_id())
                self.calls.append(PartialCall(call.name, call.arguments, call.complete))
                delta.tool_calls.append(ToolCallDelta(index, call.arguments, self.ids[index], call.name))
            elif len(call.arguments) > len(self.calls[index].arguments):
                sent = self.calls[index]
                delta.tool_calls.append(ToolCallDelta(index, call.arguments[len(sent.arguments):]))
                sent.arguments = call.arguments
            self.calls[index].complete = call.complete
        stable = scan.pieces[:scan.num_stable]
        self.settled_text += "".join(p for p in stable if isinstance(p, str))
        self.settled_calls += [p for p in stable if isinstance(p, PartialCall)]
        self.pos = scan.stable_pos
        return delta

    def finish(self) -> ParsedDelta:
        """Flush what was held back: the text has ended."""
        return self.feed("", final=True)

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The calls so far (their arguments as far as they have come)."""
        return [ToolCall(i, self.ids[i], c.name, c.arguments) for i, c in enumerate(self.calls)]
