"""Client transport behaviour against a scripted server: retries only before the first response,
metadata (traceparent, bearer token) passthrough, TLS and mutual TLS with generated certificates."""

from __future__ import annotations

import datetime
import json

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from clients.async_client import AsyncTandemClient
from clients.client import TandemClient
from clients.connection import RetryPolicy, TlsConfig
from clients.errors import TandemError
from tests.clients.conftest import run_async
from tests.clients.fake_frontend import ScriptedGeneration, ScriptedServer

FAST = RetryPolicy(retries=3, initial_backoff_s=0.01, max_backoff_s=0.05)
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def scripted():
    servers = []

    def start(**behaviour) -> ScriptedServer:
        servers.append(ScriptedServer(ScriptedGeneration(**behaviour)))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


# ---- retries ----------------------------------------------------------------------------------------
def test_unavailable_before_any_response_is_retried_until_it_succeeds(scripted):
    server = scripted(fail_before=2)
    with TandemClient(server.address, retry=FAST, timeout=10) as client:
        assert "".join(c.text for c in client.generate("a b c")) == "a b c "
    assert server.servicer.attempts == 3


def test_retries_give_up_after_the_policy_allows(scripted):
    server = scripted(fail_before=100)
    with TandemClient(server.address, retry=RetryPolicy(retries=2, initial_backoff_s=0.01), timeout=10) as client:
        with pytest.raises(TandemError) as excinfo:
            client.tokenize("a b")
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE and "scripted" in excinfo.value.message
    assert server.servicer.attempts == 3


def test_a_stream_that_has_begun_is_never_retried(scripted):
    server = scripted(fail_after_first=True)
    received = []
    with TandemClient(server.address, retry=FAST, timeout=10) as client:
        with pytest.raises(TandemError) as excinfo:
            for chunk in client.generate("a b c"):
                received.append(chunk.text)
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE and "mid-stream" in excinfo.value.message
    assert received == ["a "] and server.servicer.attempts == 1


def test_no_retries_when_disabled(scripted):
    server = scripted(fail_before=1)
    with TandemClient(server.address, retry=RetryPolicy(retries=0), timeout=10) as client:
        with pytest.raises(TandemError):
            list(client.generate("a"))
    assert server.servicer.attempts == 1


def test_async_client_retries_the_same_way(scripted):
    before, during = scripted(fail_before=2), scripted(fail_after_first=True)

    async def run():
        async with AsyncTandemClient(before.address, retry=FAST, timeout=10) as client:
            text = "".join([c.text async for c in client.generate("x y")])
        async with AsyncTandemClient(during.address, retry=FAST, timeout=10) as client:
            with pytest.raises(TandemError) as excinfo:
                [c async for c in client.generate("x y")]
        return text, excinfo.value.code

    assert run_async(run()) == ("x y ", grpc.StatusCode.UNAVAILABLE)
    assert (before.servicer.attempts, during.servicer.attempts) == (3, 1)


def test_retry_policy_rejects_more_attempts_than_grpc_allows():
    with pytest.raises(ValueError, match="retries"):
        RetryPolicy(retries=5).service_config()


# ---- metadata ---------------------------------------------------------------------------------------
def test_traceparent_token_and_metadata_reach_the_server(scripted):
    server = scripted()
    with TandemClient(server.address, metadata={"x-team": "search"}, token="s3cret", timeout=10) as client:
        list(client.generate("a", traceparent=TRACEPARENT, metadata=[("x-call", "1")]))
        client.tokenize("a")
    seen_stream, seen_unary = server.servicer.metadata
    assert seen_stream["traceparent"] == TRACEPARENT and seen_stream["x-call"] == "1"
    for seen in (seen_stream, seen_unary):
        assert seen["x-team"] == "search" and seen["authorization"] == "Bearer s3cret"
    assert "traceparent" not in seen_unary


# ---- TLS --------------------------------------------------------------------------------------------
def _certificate(subject: str, key, issuer_name, issuer_key, *, ca: bool, san: str | None = None):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(san)]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def pki():
    """A CA, a server certificate for 'tandem.test' and a client certificate, all signed by the CA."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem test CA")])
    ca = _certificate("tandem test CA", ca_key, ca_name, ca_key, ca=True)
    server_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    return {
        "ca": _pem(ca),
        "server": (_key_pem(server_key), _pem(_certificate("server", server_key, ca_name, ca_key, ca=False,
                                                           san="tandem.test"))),
        "client": (_key_pem(client_key), _pem(_certificate("client", client_key, ca_name, ca_key, ca=False))),
    }


@pytest.fixture
def mtls_server(pki):
    credentials = grpc.ssl_server_credentials([pki["server"]], root_certificates=pki["ca"],
                                              require_client_auth=True)
    server = ScriptedServer(ScriptedGeneration(), credentials)
    yield server
    server.stop()


def test_mutual_tls_with_a_client_certificate_and_server_name_override(mtls_server, pki, tmp_path):
    (tmp_path / "ca.pem").write_bytes(pki["ca"])
    (tmp_path / "key.pem").write_bytes(pki["client"][0])
    (tmp_path / "cert.pem").write_bytes(pki["client"][1])
    tls = TlsConfig(root_ca=tmp_path / "ca.pem", client_cert=str(tmp_path / "cert.pem"),
                    client_key=tmp_path / "key.pem", server_name="tandem.test")
    with TandemClient(mtls_server.address, tls=tls, timeout=10) as client:
        assert client.tokenize("a b c").tokens == ("a", "b", "c")

    async def run():
        async with AsyncTandemClient(mtls_server.address, tls=tls, timeout=10) as ac:
            return "".join([c.text async for c in ac.generate("d e")])

    assert run_async(run()) == "d e "


def test_tls_handshake_failures_are_unavailable(mtls_server, pki):
    no_client_cert = TlsConfig(root_ca=pki["ca"], server_name="tandem.test")
    wrong_name = TlsConfig(root_ca=pki["ca"], client_cert=pki["client"][1], client_key=pki["client"][0],
                           server_name="elsewhere.test")
    for tls in (no_client_cert, wrong_name):
        with TandemClient(mtls_server.address, tls=tls, retry=RetryPolicy(retries=0), timeout=10) as client:
            with pytest.raises(TandemError) as excinfo:
                client.tokenize("a")
        assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE
    assert mtls_server.servicer.attempts == 0


def test_tls_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="both a client certificate and its key"):
        TlsConfig(client_cert=b"x").credentials()
    with pytest.raises(ValueError, match="cannot read the root CA"):
        TlsConfig(root_ca=tmp_path / "missing.pem").credentials()


def test_cli_tls_and_token_flags(mtls_server, pki, tmp_path):
    from tests.clients.conftest import run_cli

    files = {"ca.pem": pki["ca"], "key.pem": pki["client"][0], "cert.pem": pki["client"][1], "token": b"t0k\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    flags = ["--address", mtls_server.address, "--tls-ca", str(tmp_path / "ca.pem"), "--tls-server-name",
             "tandem.test", "--token-file", str(tmp_path / "token"), "--timeout", "10"]
    result = run_cli("tokenize", "a b c", "--json", "--tls-cert", str(tmp_path / "cert.pem"),
                     "--tls-key", str(tmp_path / "key.pem"), *flags)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tokens"] == ["a", "b", "c"]
    assert mtls_server.servicer.metadata[-1]["authorization"] == "Bearer t0k"
    refused = run_cli("tokenize", "a", "--retries", "0", *flags)  # no client certificate
    assert refused.returncode == 1 and refused.stderr.startswith("tandem: UNAVAILABLE: ")
    half = run_cli("tokenize", "a", "--tls-cert", str(tmp_path / "cert.pem"), *flags)
    assert half.returncode == 1 and "both a client certificate and its key" in half.stderr
