"""One completion's tool calls on the way out: its text goes through a ToolCallStreamer, and each message
gets the text and tool-call fields its output kind asks for."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.protocol import FinishReason, OutputKind
from services.frontend.tools.parsers import ToolCall, ToolCallDelta, ToolCallStreamer
from services.frontend.tools.request import ToolPlan


@dataclass
class ToolStep:
    """One message's share: text (new or all, per output kind), call deltas (DELTA), calls."""

    text: str
    deltas: list[ToolCallDelta] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)


class ToolOutput:
    def __init__(self, plan: ToolPlan, output_kind: OutputKind) -> None:
        self.streamer = ToolCallStreamer(plan.new_parser())
        self.delta = output_kind == OutputKind.DELTA

    def step(self, new_text: str, finished: bool) -> ToolStep:
        """Feed the completion's new text; finished flushes what the parser held back."""
        parsed = self.streamer.feed(new_text, final=finished)
        if self.delta:  # the complete calls ride along on the last message
            return ToolStep(parsed.text, parsed.tool_calls, self.streamer.tool_calls if finished else [])
        return ToolStep(self.streamer.text, [], self.streamer.tool_calls)

    def finish_reason(self, finish: FinishReason | None) -> FinishReason | None:
        """A completion that stopped (EOS, stop string) after calling tools ended with TOOL_CALLS."""
        return FinishReason.TOOL_CALLS if finish == FinishReason.STOP and self.streamer.tool_calls else finish
