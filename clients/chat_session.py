"""`tandem chat`: a terminal chat that streams the answer token by token and keeps the history.

On a terminal it prompts "you> " (with line editing); piped, each input line is one user turn
and only the answers are printed, one per line. /reset forgets the history, /exit (or EOF) quits.
Ctrl-C during an answer stops that answer (the server aborts the request) and drops the turn.
"""

from __future__ import annotations

import argparse
import sys

from clients.cli_options import client_from_args, sampling_from_args
from clients.client import TandemClient


class ChatSession:
    """The conversation so far, and one streamed turn at a time."""

    def __init__(self, client: TandemClient, sampling: dict, system: str | None = None) -> None:
        self.client = client
        self.sampling = sampling
        self.system = system
        self.history: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def turn(self, user_text: str, out=sys.stdout) -> str:
        """Send one user message, stream the answer to `out`, remember both; returns the answer."""
        messages = [*self.history, {"role": "user", "content": user_text}]
        answer = []
        for chunk in self.client.chat(messages, **self.sampling):
            answer.append(chunk.text)
            out.write(chunk.text)
            out.flush()
        out.write("\n")
        self.history = [*messages, {"role": "assistant", "content": "".join(answer)}]
        return "".join(answer)


def run(args: argparse.Namespace) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    with client_from_args(args) as client:
        session = ChatSession(client, sampling_from_args(args), args.system)
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
            if interactive:
                print("assistant> ", end="", flush=True)
            try:
                session.turn(text)
            except KeyboardInterrupt:
                if not interactive:
                    raise
                print("\n(answer stopped)", file=sys.stderr)
