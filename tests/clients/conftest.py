"""A live two-process stack (tandem-engine + tandem-frontend on a tiny random Llama with SmolLM2's
tokenizer) shared by the client, CLI, bench and Node tests; always stopped at the end."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_core.loader import default_model_path
from tests.engine_core.tiny_models import write_tiny_model
from tests.event_loops import close_loop
from tests.test_stack import ENGINE_FLAGS, VOCAB, Services

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def live_stack(tmp_path_factory):
    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny-clients"), vocab_size=VOCAB,
                                 max_position_embeddings=512)
    services = Services(["--model", str(model_dir), *ENGINE_FLAGS, "--log-level", "WARNING",
                         "--tokenizer", str(default_model_path())],  # the vocabulary for structured-output masks
                        ["--tokenizer", str(default_model_path()), "--log-level", "WARNING"])
    services.model_dir = model_dir  # for tests that compare with transformers on the same weights
    try:
        yield services
    finally:
        services.stop()


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
