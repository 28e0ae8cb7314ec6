"""`tandem chat`: a terminal chat that streams the answer token by token and keeps the history.

On a terminal it prompts "you> " (with line editing); piped, each input line is one user turn
and only the answers are printed, one per line. /reset forgets the history, /exit (or EOF) quits.
Ctrl-C during an answer stops that answer (the server aborts the request) and drops the turn.
With --tools FILE (a JSON list of {"name", "description", "parameters"}), the model's tool calls are
printed as JSON lines {"tool_call": {"id", "name", "arguments"}}; "/tool ID RESULT" answers one and the
model goes on (an ID the model never called is refused, naming the known ones). A call that max_tokens cut
is printed as {"cut_tool_call": {"id", "name", "finish_reason": "length", "arguments_json": unfinished text}}
and left out of the history. A forced --tool-choice (required or a tool's name) applies to the answer to
each message you type; the turn after a /tool result uses auto, so the model can answer with text.
"""

from __future__ import annotations

import argparse
import json
import sys

from clients.cli.options import client_from_args, lora_from_args, sampling_from_args, tools_from_args
from clients.client import TandemClient


class UnknownToolCallId(ValueError):
    """A tool result for an id the conversation has no call of; refused before any request."""


class ChatSession:
    """The conversation so far, and one streamed turn at a time."""

    def __init__(self, client: TandemClient, sampling: dict, system: str | None = None) -> None:
        self.client = client
        self.sampling = sampling  # sampling keywords, lora_name, and tools / tool_choice when given
        self.system = system
        self.history: list[dict] = []
        self.cut_call_ids: set[str] = set()
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []
        self.cut_call_ids = set()  # calls max_tokens cut: shown, but never in the history to answer

    def turn(self, user_text: str, out=sys.stdout) -> str:
        """Send one user message, stream the answer to `out`, remember both; returns the answer."""
        return self._reply([*self.history, {"role": "user", "content": user_text}], self.sampling, out)

    def tool_result(self, call_id: str, result: str, out=sys.stdout) -> str:
        """Answer a tool call with its result; the model goes on from there (UnknownToolCallId, before any
        request, when the history has no call `call_id`)."""
        self.check_call_id(call_id)
        return self._reply([*self.history, {"role": "tool", "content": result, "tool_call_id": call_id}],
                           self._sampling_after_tool_result(), out)

    def known_call_ids(self) -> list[str]:
        """The ids of the whole calls in the history: the ones a tool result can answer."""
        return [call.id for message in self.history for call in message.get("tool_calls", ())]

    def check_call_id(self, call_id: str) -> None:
        known = self.known_call_ids()
        if call_id in known:
            return
        why = "was cut by max_tokens and cannot be answered" if call_id in self.cut_call_ids else "is unknown"
        raise UnknownToolCallId(f"tool call id {call_id!r} {why}; known ids: {', '.join(known) or 'none'}")

    def _sampling_after_tool_result(self) -> dict:
        # A forced choice (required or a name) would make the model call again instead of answering the result.
        if self.sampling.get("tool_choice") in (None, "auto", "none"):
            return self.sampling
        return {**self.sampling, "tool_choice": "auto"}

    def _reply(self, messages: list[dict], sampling: dict, out) -> str:
        answer, calls, finish = [], (), None
        for chunk in self.client.chat(messages, **sampling):
            answer.append(chunk.text)
            out.write(chunk.text)
            out.flush()
            calls = chunk.tool_calls or calls
            finish = chunk.finish_reason or finish
        out.write("\n")
        for call in calls:
            if call.complete:
                out.write(json.dumps({"tool_call": {"id": call.id, "name": call.name, "arguments": call.arguments}})
                          + "\n")
            else:  # cut by max_tokens: shown as it came, never run, and not sent back (the server refuses it)
                out.write(json.dumps({"cut_tool_call": {"id": call.id, "name": call.name, "finish_reason": finish,
                                                        "arguments_json": call.arguments_json}}) + "\n")
                self.cut_call_ids.add(call.id)
                print(f"(tool call {call.id} ({call.name}) was cut, finish reason {finish}: its arguments are "
                      f"unfinished, so it stays out of the history; a larger --max-tokens lets calls finish)",
                      file=sys.stderr)
        out.flush()
        reply = {"role": "assistant", "content": "".join(answer)}
        whole = [call for call in calls if call.complete]
        if whole:
            reply["tool_calls"] = whole
        self.history = [*messages, reply]
        return "".join(answer)


def run(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    with client_from_args(args) as client:
        options = {**sampling_from_args(args), **lora_from_args(args), **tools_from_args(args)}
        session = ChatSession(client, options, args.system)
        if interactive:
            print(f"chatting with {args.address}; /reset forgets the history, /exit or Ctrl-D quits", file=sys.stderr)
        while True:
            try:
                line = input("you> ") if interactive else sys.stdin.readline()
            except EOFError:
                line = ""
            if not line:  # EOF
                if interactive:
                    print(file=sys.stderr)
                return 0
            text = line.strip()
            if not text:
                continue
            if text == "/exit":
                return 0
            if text == "/reset":
                session.reset()
                print("(history cleared)", file=sys.stderr)
                continue
            tool = text.split(maxsplit=2) if text.startswith("/tool ") else None
            if tool is not None and len(tool) < 3:
                print("(usage: /tool CALL_ID RESULT)", file=sys.stderr)
                continue
            if tool is not None:
                try:
                    session.check_call_id(tool[1])
                except UnknownToolCallId as e:  # a typo must not end the conversation
                    print(f"({e})", file=sys.stderr)
                    continue
            if interactive:
                print("assistant> ", end="", flush=True)
            try:
                session.tool_result(tool[1], tool[2]) if tool else session.turn(text)
            except KeyboardInterrupt:
                if not interactive:
                    raise
                print("\n(answer stopped)", file=sys.stderr)
