"""The Shepherd Model Gateway (smg) in front of a Tandem frontend, on this machine, plus a few HTTP calls to it.

smg speaks vLLM's gRPC worker protocol to the frontend (services/frontend/gateway/servicer.py) and gives
the OpenAI chat/completions, Responses and Anthropic Messages APIs over HTTP. `Gateway` runs `smg launch` as a
child process pointed at one frontend and waits until the model is listed; `post_json` and `stream_sse`
are the two HTTP calls the demo, the tests and the benchmark make (standard library only: the client
install stays small; smg itself comes with `pip install smg`).

    python -m clients.gateway                      # make run-gateway: the stack + smg, one answer, then serve
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit


class GatewayError(RuntimeError):
    """An HTTP answer other than 200 (the status and the body say why)."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status, self.body = status, body


def smg_command() -> list[str]:
    """How to run smg: the `smg` script beside this Python (a virtualenv), else on the PATH."""
    local = Path(sys.executable).parent / "smg"
    found = str(local) if local.exists() else shutil.which("smg")
    if found is None:
        raise FileNotFoundError("smg is not installed: pip install smg (the Shepherd Model Gateway)")
    return [found]


@dataclass
class Gateway:
    """`smg launch` on `host:port` in front of the frontends at `workers` (host:port each)."""

    workers: list[str]
    host: str = "127.0.0.1"
    port: int = 30000
    metrics_port: int | None = None  # smg's Prometheus /metrics (default: a free port; smg's own is 29000)
    extra_args: list[str] = field(default_factory=list)  # more `smg launch` flags (--policy, --tool-call-parser ...)
    log_file: Path | None = None  # smg's output (default: discarded)
    startup_timeout: float = 60.0
    process: subprocess.Popen | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Gateway:
        from clients.local_stack import free_port

        self.metrics_port = self.metrics_port or free_port(self.host)
        argv = [*smg_command(), "launch", "--host", self.host, "--port", str(self.port),
                "--prometheus-host", self.host, "--prometheus-port", str(self.metrics_port),
                "--worker-urls", *(f"grpc://{w}" for w in self.workers), *self.extra_args]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
        self.process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            self.wait_for_model()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_for_model(self, timeout: float | None = None) -> str:
        """Poll until a model is listed and answers a one-token completion (smg lists the worker before it
        has fetched the tokenizer over GetTokenizer, and answers 503 until then)."""
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"smg exited with code {self.process.returncode} before serving")
            try:
                models = get_json(self.url + "/v1/models", timeout=2)["data"]
                if models:
                    post_json(self.url + "/v1/completions", {"model": models[0]["id"], "prompt": "Hi",
                                                             "max_tokens": 1}, timeout=30)
                    return models[0]["id"]
            except (OSError, GatewayError, KeyError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"smg at {self.url} listed no model within {timeout or self.startup_timeout:.0f} s")

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- HTTP -----------------------------------------------------------------------------
def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout), parts.path or "/"


def get_json(url: str, timeout: float = 60) -> dict:
    return _request_json("GET", url, None, timeout)


def post_json(url: str, body: dict, timeout: float = 300) -> dict:
    return _request_json("POST", url, body, timeout)


def _request_json(method: str, url: str, body: dict | None, timeout: float) -> dict:
    connection, path = _connection(url, timeout)
    try:
        if body is None:
            connection.request(method, path)
        else:
            connection.request(method, path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
        if response.status != 200:
            raise GatewayError(response.status, text)
        return json.loads(text)
    finally:
        connection.close()


def stream_sse(url: str, body: dict, timeout: float = 300) -> Iterator[dict]:
    """POST with "stream": true; yields each server-sent event's JSON until [DONE]. Closing the generator
    early closes the connection (a client that went away)."""
    connection, path = _connection(url, timeout)
    try:
        connection.request("POST", path, json.dumps({**body, "stream": True}),
                           {"Content-Type": "application/json", "Accept": "text/event-stream"})
        response = connection.getresponse()
        if response.status != 200:
            raise GatewayError(response.status, response.read().decode())
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
    finally:
        connection.close()


# ---- make run-gateway -----------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    from clients.local_stack import LocalStack, free_port

    parser = argparse.ArgumentParser(description="The Tandem stack on the embedded SmolLM2 with smg in front of "
                                                 "it (OpenAI HTTP API on loopback): one streamed chat answer, then "
                                                 "serve until Ctrl-C")
    parser.add_argument("--port", type=int, default=30000, help="smg's HTTP port (default: %(default)s)")
    parser.add_argument("--prompt", default="What is the capital of France?", help="the demo's user message")
    parser.add_argument("--once", action="store_true", help="stop after the demo answer")
    args = parser.parse_args(argv)
    quiet = ["--log-level", "WARNING"]
    print("starting tandem-engine, tandem-frontend and smg on the embedded SmolLM2 ...", flush=True)
    # fp32: SmolLM2-135M's greedy answer to the demo question sits on a knife's edge in lower precision
    engine_args = ["--max-model-len", "2048", "--dtype", "float32", *quiet]
    with LocalStack(frontend_port=free_port(), engine_port=free_port(), engine_args=engine_args,
                    frontend_args=quiet) as stack:
        with Gateway([stack.frontend_address], port=args.port) as gateway:
            model = gateway.wait_for_model()
            print(f"smg at {gateway.url} (model {model!r}) -> frontend at {stack.frontend_address}\n", flush=True)
            print(f"user> {args.prompt}\nassistant> ", end="", flush=True)
            request = {"model": model, "messages": [{"role": "user", "content": args.prompt}], "temperature": 0,
                       "max_tokens": 64}
            for event in stream_sse(gateway.url + "/v1/chat/completions", request):
                for choice in event.get("choices", []):
                    print(choice.get("delta", {}).get("content") or "", end="", flush=True)
            print("\n")
            if args.once:
                return 0
            print(f"serving; try:\n  curl -s {gateway.url}/v1/chat/completions -H 'Content-Type: application/json' "
                  f"-d '{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'\n"
                  "Ctrl-C stops everything.", flush=True)
            try:
                while gateway.process.poll() is None and all(stack.pids):
                    time.sleep(0.5)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
