"""Helpers of the client, CLI, bench and Node tests; their live stack (`live_stack`) is in tests/conftest.py,
shared with the docs' snippets (tests/test_doc_snippets.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from tests.event_loops import close_loop

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`tandem ARGS` in a subprocess, as a user runs it; returns the finished process (text output)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("TANDEM_API_TOKEN", None)
    return subprocess.run([sys.executable, "-m", "clients.cli", *args], input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def run_async(coro):
    """Run a coroutine on a fresh event loop without touching the thread's current loop
    (asyncio.run would leave none set, which breaks later code that asks for one)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        close_loop(loop)
