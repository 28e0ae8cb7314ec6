"""`tandem serve` as a user runs it: it keeps the stack up when the engine core dies, and SIGTERM stops all.

Real processes on free ports: `python -m clients.cli serve` starts tandem-engine (a tiny random Llama
in a Hugging Face folder that also holds SmolLM2's tokenizer, so the frontend finds one there) and
tandem-frontend; the test SIGKILLs the engine, waits for the supervisor's restart, and sends the
next request through the same frontend.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

from clients.client import TandemClient
from clients.local_stack import RestartPolicy, SupervisedProcess, free_port, wait_until_serving
from engine_core.loader import default_model_path
from services.frontend.tokenizer import load_tokenizer
from tests.clients.conftest import REPO
from tests.engine_core.tiny_models import write_tiny_model
from tests.test_stack import ENGINE_FLAGS, VOCAB

WAIT_S = 120.0


def _wait_for(predicate, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_serve_restarts_a_killed_engine_and_sigterm_stops_everything(tmp_path):
    model = write_tiny_model(tmp_path / "model", vocab_size=VOCAB, max_position_embeddings=512)
    load_tokenizer(default_model_path()).tokenizer.save(str(model / "tokenizer.json"))
    port, engine_port = free_port(), free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "clients.cli", "serve", "--model", str(model), "--port", str(port),
             "--engine-port", str(engine_port), "--", *ENGINE_FLAGS, "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    pids: list[int] = []
    try:
        wait_until_serving(f"127.0.0.1:{port}", WAIT_S, serve)
        banner = next(line for line in serve.stdout if line.startswith("tandem: serving"))  # after the services'
        engine_pid, frontend_pid = map(int, re.search(r"pid (\d+); frontend pid (\d+)", banner).groups())
        pids += [engine_pid, frontend_pid]
        with TandemClient(f"127.0.0.1:{port}", timeout=60) as client:
            assert len(list(client.generate("Hello", max_tokens=4, ignore_eos=True))) > 0

            os.kill(engine_pid, signal.SIGKILL)
            restarted = _wait_for(lambda: re.search(r"engine core restarted \(pid (\d+)\)", log_path.read_text()),
                                  "the engine core's restart")
            pids.append(int(restarted.group(1)))
            assert "engine core was killed by SIGKILL; restarting it in" in log_path.read_text()
            _wait_for(lambda: client.server_info().engines[0].connected, "the frontend to reconnect")

            chunks = list(client.generate("The capital of France is", max_tokens=8, ignore_eos=True))
            assert sum(len(chunk.token_ids) for chunk in chunks) == 8
            assert chunks[-1].finish_reason == "length"
        assert serve.poll() is None and _running(frontend_pid)  # the stack stayed up, the same frontend

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(WAIT_S) == 0
        assert not any(_running(pid) for pid in pids)
    finally:
        if serve.poll() is None:  # a failed test: tandem serve stops its services on SIGTERM
            serve.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                serve.wait(30)
        for pid in [serve.pid, *pids]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        serve.wait()
        serve.stdout.close()


def test_a_service_that_keeps_failing_is_restarted_with_backoff_then_given_up():
    said: list[str] = []
    policy = RestartPolicy(backoff_initial_s=0.1, backoff_max_s=0.3, stable_s=60.0, max_restarts=3)
    service = SupervisedProcess("engine core", "tandem_no_such_module", [], policy, said.append)
    service.spawn()  # python -m <missing module> exits with code 1 at once
    _wait_for(lambda: not service.check(time.monotonic()), "the supervisor to give up", timeout=30)
    assert [m.split(";")[1].strip() for m in said if "exited" in m] == [
        "restarting it in 0.1 s", "restarting it in 0.2 s", "restarting it in 0.3 s",  # doubling, capped
        "it stopped 4 times in a row within 60 s of starting, so it is not restarted again (see its log above)"]
    assert sum("restarted (pid" in m for m in said) == 3
