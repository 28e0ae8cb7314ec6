"""tandem-engine and tandem-frontend as real processes, every link secured from the command line:
client -(TLS + bearer token)-> frontend -(mutual TLS)-> engine core, serving a tiny random Llama."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

from clients.local_stack import free_port
from services.security.transport import ChannelTransport
from tests.frontend.conftest import smollm2_gguf
from tests.security.conftest import tls_client

TOKEN = "stack-token-3"


class Process:
    """A service subprocess whose stderr is kept for the failure message; always stopped."""

    def __init__(self, tmp_path, module: str, *args: str) -> None:
        self.log = tmp_path / f"{module}.log"
        with self.log.open("wb") as log:
            self.popen = subprocess.Popen([sys.executable, "-m", module, *args], stdout=log, stderr=log)

    def wait_serving(self, target: str, transport: ChannelTransport, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        with transport.channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.popen.poll() is None, f"exited with {self.popen.returncode}:\n{self.log.read_text()}"
                try:
                    if health.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                            health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        pytest.fail(f"{target} not SERVING after {timeout:.0f}s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@pytest.fixture
def processes():
    started: list[Process] = []
    yield started
    for process in reversed(started):
        process.stop()


def test_generate_over_tls_token_and_mutual_tls_to_the_engine(processes, pki, tiny_engine_config, tmp_path):
    engine_port, frontend_port = free_port(), free_port()
    (tmp_path / "token").write_text(TOKEN + "\n")
    processes.append(Process(
        tmp_path, "services.engine", "--host", "127.0.0.1", "--port", str(engine_port),
        "--model", tiny_engine_config.model.model, "--dtype", "float32", "--max-model-len", "96",
        "--block-size", "4", "--num-blocks", "64", "--device", "cpu",
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca)))
    processes[-1].wait_serving(f"127.0.0.1:{engine_port}", tls_client(pki.ca, pki.client_cert, pki.client_key))
    processes.append(Process(
        tmp_path, "services.frontend", "--host", "127.0.0.1", "--port", str(frontend_port),
        "--engine", f"127.0.0.1:{engine_port}", "--tokenizer", str(smollm2_gguf()),
        "--engine-tls-ca", str(pki.ca), "--engine-tls-cert", str(pki.client_cert),
        "--engine-tls-key", str(pki.client_key), "--engine-tls-server-name", "localhost",
        "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--api-token-file", str(tmp_path / "token")))
    client = tls_client(pki.ca)
    processes[-1].wait_serving(f"127.0.0.1:{frontend_port}", client)  # health needs no token

    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
                                             sampling_params=common_pb2.SamplingParams(
                                                 temperature=0.0, max_tokens=4, ignore_eos=True))
    with client.channel(f"127.0.0.1:{frontend_port}") as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(stub.Generate(request, timeout=30))
        assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
        responses = list(stub.Generate(request, timeout=60, metadata=(("authorization", f"Bearer {TOKEN}"),)))
    completion = [t for r in responses for c in r.completions for t in c.token_ids]
    assert len(completion) == 4 and all(0 <= t < 256 for t in completion)
    assert responses[-1].completions[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
