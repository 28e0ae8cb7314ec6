"""The tool-call dataclasses every parser and the output processor share (no protos)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PartialCall:
    """A call as far as a parser has read it: the name is known, the arguments may still grow.

    `arguments` is JSON text and only ever grows by appending (a stream's fragments are its slices).
    """

    name: str
    arguments: str
    complete: bool = False


@dataclass(frozen=True)
class ToolCall:
    """One finished call of a completion (tandem.v1.ToolCall)."""

    index: int
    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ToolCallDelta:
    """News about call `index`: id and name on its first delta, then fragments of its arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedDelta:
    """What one chunk of model text adds: plain text for the user and tool-call news."""

    text: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class Scan:
    """A parser's reading of the text from a position: `pieces` (plain text or calls), of which the first
    `num_stable` are final and end at `stable_pos` (the next scan starts there)."""

    pieces: list[str | PartialCall] = field(default_factory=list)
    num_stable: int = 0
    stable_pos: int = 0

    def settle(self, pos: int) -> None:
        """Everything appended so far is final and the text up to `pos` is read."""
        self.num_stable, self.stable_pos = len(self.pieces), pos
