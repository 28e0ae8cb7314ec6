"""docker/healthcheck.py over TLS and mutual TLS, the exec probe of deploy/k8s/components/tls.

A real grpc.health.v1 server on loopback with the test PKI's server certificate that requires client
certificates from the test CA; the script runs as the kubelet would run it (a subprocess, exit code).
The plaintext path is covered in tests/observability/test_compose.py.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.security.tls import server_credentials
from tests.deploy.conftest import ROOT
from tests.deploy.conftest import healthcheck as healthcheck_script

SERVICE = "tandem.v1.Test"


@pytest.fixture
def mtls_health_server(pki):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    for name in ("", SERVICE):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(pki.server_cert, pki.server_key, pki.ca))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def healthcheck(*args) -> tuple[int, str]:
    result = subprocess.run([sys.executable, str(ROOT / "docker" / "healthcheck.py"), *map(str, args)],
                            capture_output=True, text=True, timeout=30)
    return result.returncode, result.stdout + result.stderr


def test_serving_over_mutual_tls_with_the_probe_flags(mtls_health_server, pki):
    client = (f"--tls-ca={pki.ca}", f"--tls-cert={pki.client_cert}", f"--tls-key={pki.client_key}",
              "--tls-server-name=localhost")
    assert healthcheck("--service=", *client, mtls_health_server) == (0, f"{mtls_health_server}: SERVING\n")
    assert healthcheck(f"--service={SERVICE}", *client, mtls_health_server)[0] == 0
    code, output = healthcheck("--service=tandem.v1.Unknown", *client, mtls_health_server)
    assert code == 1 and "NOT_FOUND" in output


def test_fails_without_a_client_certificate_a_trusted_ca_or_the_right_name(mtls_health_server, pki):
    assert healthcheck(f"--tls-ca={pki.ca}", "--tls-server-name=localhost", mtls_health_server)[0] == 1
    client = (f"--tls-cert={pki.client_cert}", f"--tls-key={pki.client_key}")
    assert healthcheck(f"--tls-ca={pki.rogue_ca}", *client, "--tls-server-name=localhost", mtls_health_server)[0] == 1
    assert healthcheck(f"--tls-ca={pki.ca}", *client, "--tls-server-name=elsewhere", mtls_health_server)[0] == 1
    assert healthcheck(mtls_health_server)[0] == 1  # plaintext against a TLS port


def test_rejects_incomplete_tls_flags(pki):
    code, output = healthcheck(f"--tls-ca={pki.ca}", f"--tls-cert={pki.client_cert}", "127.0.0.1:1")
    assert code == 2 and "--tls-cert and --tls-key go together" in output
    code, output = healthcheck("--tls-server-name=x", "127.0.0.1:1")
    assert code == 2 and "need --tls-ca" in output


def test_without_an_address_it_probes_the_port_its_server_was_started_with():
    find = healthcheck_script.server_port
    engine = ["/opt/tandem/bin/python", "/opt/tandem/bin/tandem-engine", "--host", "0.0.0.0", "--port", "6000"]
    assert find([["/bin/sh", "-c", "sleep 1"], engine]) == 6000
    assert find([["/opt/tandem/bin/tandem-frontend", "--engine", "engine:50061", "--port=7000"]]) == 7000
    assert find([["python3", "/opt/tandem/bin/tandem-frontend", "--metrics-port", "8051"]]) == 50051  # its default
    assert find([["python", "/app/docker/healthcheck.py"], ["bash"]]) is None


def test_it_reads_the_command_lines_of_the_processes_it_can_see(tmp_path):
    for pid, argv in (("1", b"python3\0/opt/tandem/bin/tandem-engine\0--port\0006000\0"), ("42", b"")):
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "cmdline").write_bytes(argv)  # a kernel thread's cmdline is empty
    (tmp_path / "self").mkdir()
    assert healthcheck_script.running_commands(tmp_path) == [["python3", "/opt/tandem/bin/tandem-engine", "--port",
                                                              "6000"]]
