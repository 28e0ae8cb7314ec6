"""`tandem serve` as a user runs it: one command line for the pair, its ports its own, a stack that stays up.

Real processes on free ports: `python -m clients.cli serve` starts tandem-engine (a tiny random Llama
in a Hugging Face folder that also holds SmolLM2's tokenizer, so the frontend finds one there) and
tandem-frontend. One traced stack (`tandem serve MODEL --otel --otlp-endpoint URL`, spans into a real OTLP
receiver in this process) is shared by the tests that leave it up: a trace across both services, a second
stack refused on its ports. The restart test SIGKILLs the engine of a stack of its own, waits for the
supervisor's restart, and sends the next request through the same frontend. Command lines that would break
the pair are refused before anything starts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from clients.cli import serve_command
from clients.cli.main import build_parser, main
from clients.client import TandemClient
from clients.local_stack import RestartPolicy, SupervisedProcess, free_port, wait_until_serving
from engine_core.loader import default_model_path
from services.engine.__main__ import build_parser as engine_parser
from services.frontend.__main__ import build_parser as frontend_parser
from services.frontend.__main__ import parse_args as frontend_parse_args
from services.frontend.tokenizer import load_tokenizer
from tests.clients.conftest import REPO
from tests.engine_core.tiny_models import write_tiny_model
from tests.observability.otlp_receiver import OtlpReceiver
from tests.services.test_ports import can_join_with_so_reuseport
from tests.test_stack import ENGINE_FLAGS, VOCAB

WAIT_S = 120.0
REFUSAL_S = 10.0  # a command refusing a taken port exits within this, interpreter start included


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


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A tiny random Llama in a Hugging Face folder that also holds SmolLM2's tokenizer."""
    folder = write_tiny_model(tmp_path_factory.mktemp("serve") / "model", vocab_size=VOCAB, max_position_embeddings=512)
    load_tokenizer(default_model_path()).tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def _stop(serve: subprocess.Popen, pids: list[int]) -> None:
    """SIGTERM `tandem serve` (it stops its services), then SIGKILL whatever is left of it and `pids`."""
    if serve.poll() is None:
        serve.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            serve.wait(30)
    for pid in [serve.pid, *pids]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    serve.wait()
    serve.stdout.close()


def _service_pids(serve: subprocess.Popen) -> list[int]:
    """The engine's and the frontend's pids, from the banner tandem serve prints once both serve."""
    banner = next(line for line in serve.stdout if line.startswith("tandem: serving"))  # after the services'
    return list(map(int, re.search(r"pid (\d+); frontend pid (\d+)", banner).groups()))


@dataclass
class TracedStack:
    model: Path
    port: int
    engine_port: int
    serve: subprocess.Popen
    log_path: Path  # tandem serve's stderr, and its services'
    receiver: OtlpReceiver
    pids: list[int] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def traced_stack(model, tmp_path_factory):
    """`tandem serve MODEL --otel --otlp-endpoint URL`, left up for the module; stopped at its end."""
    receiver = OtlpReceiver()
    port, engine_port = free_port(), free_port()
    log_path = tmp_path_factory.mktemp("traced-serve") / "serve.log"
    env = {name: value for name, value in os.environ.items() if not name.startswith("OTEL_")}
    env.update(PYTHONUNBUFFERED="1", OTEL_BSP_SCHEDULE_DELAY="100")  # spans leave within 0.1 s, not 5 s
    with open(log_path, "w") as log:
        serve = subprocess.Popen(
            [sys.executable, "-m", "clients.cli", "serve", str(model), "--otel", "--otlp-endpoint", receiver.endpoint,
             "--port", str(port), "--engine-port", str(engine_port), "--", *ENGINE_FLAGS, "--log-level", "WARNING"],
            stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO, env=env)
    stack = TracedStack(model, port, engine_port, serve, log_path, receiver)
    try:
        wait_until_serving(stack.address, WAIT_S, serve)
        stack.pids = _service_pids(serve)
        yield stack
    finally:
        _stop(serve, stack.pids)
        receiver.stop()


def test_serve_takes_the_model_as_its_argument_and_says_what_it_does_with_its_flags(traced_stack):
    with TandemClient(traced_stack.address, timeout=60) as client:
        assert Path(client.model_info().model_path).resolve() == traced_stack.model.resolve()
        chunks = list(client.generate("Hello", max_tokens=4, ignore_eos=True))
    assert sum(len(chunk.token_ids) for chunk in chunks) == 4
    said = traced_stack.log_path.read_text().splitlines()
    assert ("tandem: tracing on in the frontend and the engine core, one trace per request, over OTLP to "
            f"{traced_stack.receiver.endpoint}") in said
    assert f"tandem: to the engine core: {' '.join([*ENGINE_FLAGS, '--log-level', 'WARNING'])}" in said


def test_serve_otel_traces_a_request_across_the_frontend_and_the_engine(traced_stack):
    with TandemClient(traced_stack.address, timeout=60) as client:
        list(client.generate("The capital of France is", max_tokens=4, ignore_eos=True, request_id="traced-serve"))

    def the_rpc_request_and_engine_spans(spans):
        """The three spans of the request once all have arrived (each service exports its spans in batches, the
        RPC's own span last: it ends after the response)."""
        requests = [s for s in spans if (s.service, s.name) == ("tandem-frontend", "llm_request")
                    and s.attributes.get("gen_ai.request.id") == "traced-serve"]
        engine = [s for s in spans if (s.service, s.name) == ("tandem-engine", "engine_core.request")
                  and requests and s.parent_span_id == requests[0].span_id]
        rpc = [s for s in spans if requests and s.span_id == requests[0].parent_span_id]
        return (rpc, requests[0], engine[0]) if engine and rpc else None

    rpc, request, engine = traced_stack.receiver.wait_for(
        the_rpc_request_and_engine_spans, "the RPC's span, its llm_request child and the engine's grandchild")
    assert engine.trace_id == request.trace_id  # one trace: the engine's span is the frontend span's child
    assert [(s.service, s.name, s.trace_id) for s in rpc] == [
        ("tandem-frontend", "/tandem.v1.GenerationService/Generate", request.trace_id)]


def test_a_second_stack_on_a_taken_port_is_refused_and_the_first_keeps_serving(traced_stack):
    port, engine_port = traced_stack.port, traced_stack.engine_port
    attempts = [  # (program, the flag naming the taken port, the port, its command line)
        ("tandem", "--port", port, ["clients.cli", "serve", "--port", str(port), "--engine-port", str(free_port())]),
        ("tandem", "--engine-port", engine_port,
         ["clients.cli", "serve", "--port", str(free_port()), "--engine-port", str(engine_port)]),
        ("tandem-engine", "--port", engine_port, ["services.engine", "--port", str(engine_port)]),
        ("tandem-frontend", "--port", port,
         ["services.frontend", "--port", str(port), "--engine", f"127.0.0.1:{engine_port}"]),
    ]
    for program, flag, taken, argv in attempts:
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert (result.returncode, result.stderr.splitlines()) == (
            1, [f"{program}: 127.0.0.1:{taken} is in use (by another tandem?); {flag} picks another port"]), argv
        # "within a few seconds": the ports are looked at before any model loads (under 1 s here; busy machines
        # get room)
        assert time.monotonic() - started < REFUSAL_S, (argv, time.monotonic() - started)

    # the first stack's ports are still its own (nothing may join them), and it serves every request
    assert not can_join_with_so_reuseport(port) and not can_join_with_so_reuseport(engine_port)
    with TandemClient(traced_stack.address, timeout=60) as client:
        for i in range(8):
            chunks = list(client.generate(f"Request {i}", max_tokens=4, ignore_eos=True))
            assert (sum(len(chunk.token_ids) for chunk in chunks), chunks[-1].finish_reason) == (4, "length")
        assert client.server_info().engines[0].connected
    assert traced_stack.serve.poll() is None and "restart" not in traced_stack.log_path.read_text()


@pytest.mark.parametrize("argv, reason", [
    (["--", "--port", "52999"], "`-- --port 52999` is refused: the frontend dials the engine core at tandem serve's "
                                "--host and --engine-port; give `tandem serve --engine-port 52999`"),
    (["--", "--host", "0.0.0.0"], "`-- --host 0.0.0.0` is refused"),
    (["--", "--otel"], "`-- --otel` is refused: tandem serve gives it to both services; give `tandem serve --otel`"),
    (["--", "--tls-cert", "engine.pem", "--tls-key", "engine.key"], "in plaintext on this machine; for TLS between "
                                                                    "them run tandem-engine and tandem-frontend"),
    (["--", "--model", "other.gguf"], "`-- --model other.gguf` is refused: tandem serve gives the engine core its "
                                      "model; give `tandem serve other.gguf`"),
    (["--", "--no-such-flag"], "flags after `--` go to tandem-engine, which says: unrecognized arguments: "
                               "--no-such-flag"),
    (["--max-num-seqs", "64"], "--max-num-seqs is tandem-engine's: give it after `--`"),
    (["--max-unsent-tokens", "8"], "--max-unsent-tokens is a tandem-frontend flag tandem serve does not pass on: "
                                   "run tandem-engine and tandem-frontend on their own"),
    (["no-such-model.gguf"], "model no-such-model.gguf not found: give a Hugging Face folder or a .gguf file"),
    (["--port", "52051", "--engine-port", "52051"], "--port and --engine-port are both 52051"),
])
def test_serve_refuses_a_command_line_that_would_break_the_pair_before_starting_anything(argv, reason, capsys):
    assert main(["serve", *argv]) == 2
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("tandem serve: error: ") and reason in said[0], said


def _serve_args(argv: list[str]) -> argparse.Namespace:
    argv, engine_args = serve_command.split_engine_args(["serve", *argv])
    args = build_parser().parse_args(argv)
    args.engine_args = engine_args
    return args


def test_serve_gives_each_flag_to_the_service_it_belongs_to(model):
    tokenizer, endpoint = str(default_model_path()), "http://127.0.0.1:4317"
    stack, said = serve_command.build_stack(_serve_args([
        str(model), "--port", str(free_port()), "--engine-port", str(free_port()), "--otel", "--otlp-endpoint",
        endpoint, "--log-format", "json", "--log-level", "WARNING", "--tokenizer", tokenizer, "--metrics-port", "0",
        "--max-tokens", "64", "--max-n", "2", "--max-prompt-tokens", "100", "--max-waiting-requests", "9",
        "--", "--max-num-seqs", "8"]))
    # each service reads them with its own parser, as it will when started
    engine = engine_parser().parse_args(stack.engine_args)
    assert (engine.model, engine.otel, engine.otlp_endpoint, engine.log_format, engine.log_level, engine.tokenizer,
            engine.max_num_seqs, engine.metrics_port) == (str(model), True, endpoint, "json", "WARNING", tokenizer, 8,
                                                          None)
    frontend = frontend_parse_args([*stack.frontend_args, "--engine", stack.engine_address])
    assert (frontend.otel, frontend.otlp_endpoint, frontend.log_format, frontend.log_level, frontend.tokenizer,
            frontend.metrics_port, frontend.max_tokens, frontend.max_n, frontend.max_prompt_tokens,
            frontend.max_waiting_requests) == (True, endpoint, "json", "WARNING", tokenizer, 0, 64, 2, 100, 9)
    assert said == [
        f"tracing on in the frontend and the engine core, one trace per request, over OTLP to {endpoint}",
        f"the frontend tokenizes with {tokenizer}; the engine core builds structured-output masks from it",
        "both services log with --log-format json --log-level WARNING",
        "the frontend's Prometheus /metrics on 127.0.0.1:0; the engine core's with `-- --metrics-port PORT`",
        "to the frontend: --metrics-port 0 --max-tokens 64 --max-n 2 --max-prompt-tokens 100 --max-waiting-requests 9",
        "to the engine core: --max-num-seqs 8",
    ]


# tandem-frontend's flags that tandem serve does not take, and why: a new frontend flag fails the test
# below until it is either passed on by tandem serve or named here
NOT_THROUGH_SERVE = {
    "--engine": "tandem serve points the frontend at its own engine core",
    "--engine-resolve-interval": "one engine, by address",
    "--routing-policy": "one engine", "--routing-balance-abs": "one engine", "--routing-balance-rel": "one engine",
    "--cpu-priority": "tandem serve sets low: the frontend shares the engine's cores",
    "--grace": "tandem serve's stop: SIGTERM, the services' own grace",
    "--max-unsent-tokens": "rarely changed: run the services on their own",
    "--max-stop-strings": "request limits beyond the common ones: run the services on their own",
    "--max-stop-string-length": "", "--max-schema-bytes": "", "--max-regex-length": "", "--max-choices": "",
    "--max-tool-calls": "",
    "--tls-cert": "TLS: run the services on their own (docs/security.md)", "--tls-key": "", "--tls-client-ca": "",
    "--engine-tls-ca": "", "--engine-tls-cert": "", "--engine-tls-key": "", "--engine-tls-server-name": "",
}


def _long_flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")}


def test_every_frontend_flag_is_taken_by_serve_or_named_as_not():
    serve = serve_command.add_parser(argparse.ArgumentParser().add_subparsers())
    frontend_flags, serve_flags = _long_flags(frontend_parser()), _long_flags(serve)
    assert frontend_flags - serve_flags - {"--help"} == set(NOT_THROUGH_SERVE)
    passed_on = {"--" + dest.replace("_", "-") for dest in serve_command.FRONTEND_ONLY + serve_command.BOTH_SERVICES}
    assert passed_on <= frontend_flags
    assert {"--" + dest.replace("_", "-") for dest in serve_command.BOTH_SERVICES} <= _long_flags(engine_parser())


def test_tandem_version_is_the_installed_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"tandem {importlib.metadata.version('tandem')}\n"


def test_serve_restarts_a_killed_engine_and_sigterm_stops_everything(model, tmp_path):
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
        pids += _service_pids(serve)
        engine_pid, frontend_pid = pids
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
        _stop(serve, pids)  # a failed test: tandem serve stops its services on SIGTERM


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
