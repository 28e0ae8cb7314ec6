"""The OpenSSL recipe of docs/deployment.md (Kubernetes, step 5) makes a CA and leaf certificates that are not
CAs, as tests/security/pki.py makes them, and the services and clients speak (mutual) TLS with them."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from tandem.v1 import generation_pb2

from services.security.tls import server_credentials
from services.security.transport import ServerTransport
from tests.security.conftest import tls_client

REPO = Path(__file__).resolve().parents[2]
DOC, CHAT_JS = REPO / "docs" / "deployment.md", REPO / "clients" / "node" / "chat.js"
LEAVES = {  # name -> (DNS names, extended key usages), as the recipe's `leaf` lines ask
    "tandem-engine": ({"tandem-engine"}, {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}),
    "tandem-frontend-client": ({"tandem-frontend"}, {ExtendedKeyUsageOID.CLIENT_AUTH}),
    "tandem-frontend": ({"tandem-frontend", "tandem.example.com"}, {ExtendedKeyUsageOID.SERVER_AUTH}),
}


def documented_recipe() -> str:
    """The openssl lines of the docs' certificate block: from the CA's `openssl req` to the last `leaf`."""
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S) if "leaf()" in b]
    assert len(blocks) == 1, f"{DOC.name} should hold one certificate recipe (a block defining leaf())"
    block = blocks[0]
    lines = block.splitlines()
    last_leaf = max(i for i, line in enumerate(lines) if line.startswith("leaf "))
    return "\n".join(lines[:last_leaf + 1]) + "\n"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None or shutil.which("bash") is None:
        pytest.skip("the documented recipe needs openssl and bash")
    folder = tmp_path_factory.mktemp("documented-pki")
    subprocess.run(["bash", "-euo", "pipefail", "-c", documented_recipe()], cwd=folder, check=True, capture_output=True)
    return folder


def load(folder: Path, name: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate((folder / f"{name}.crt").read_bytes())


def test_the_recipe_makes_a_ca_and_leaves_that_are_not_cas(certificates):
    ca = load(certificates, "ca")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, (dns_names, usages) in LEAVES.items():
        leaf = load(certificates, name)
        constraints = leaf.extensions.get_extension_for_class(x509.BasicConstraints)
        assert constraints.critical and not constraints.value.ca, f"{name} is a CA: rustls/webpki refuse it as a leaf"
        assert leaf.issuer == ca.subject
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert set(names.get_values_for_type(x509.DNSName)) == dns_names, name
        assert set(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == usages, name
        ca.public_key().verify(leaf.signature, leaf.tbs_certificate_bytes, ec.ECDSA(leaf.signature_hash_algorithm))
    assert not list(certificates.glob("*.csr")), "the recipe leaves no signing requests behind"


def test_the_services_speak_mutual_tls_with_them(make_engine, make_frontend, certificates):
    """The engine with its certificate, reached with the frontends' client certificate; the frontend as
    `tandem chat --tls-ca ca.crt --tls-server-name tandem-frontend` reaches it (mutual TLS on top)."""
    path = {name: str(certificates / name) for name in (
        "ca.crt", "tandem-engine.crt", "tandem-engine.key", "tandem-frontend.crt", "tandem-frontend.key",
        "tandem-frontend-client.crt", "tandem-frontend-client.key")}
    as_frontend = (path["ca.crt"], path["tandem-frontend-client.crt"], path["tandem-frontend-client.key"])

    engine = make_engine(ServerTransport(credentials=server_credentials(
        path["tandem-engine.crt"], path["tandem-engine.key"], path["ca.crt"])))
    assert engine.info(tls_client(*as_frontend, server_name="tandem-engine")).vocab_size > 0
    probe = (path["ca.crt"], path["tandem-engine.crt"], path["tandem-engine.key"])  # the engine's own probes
    assert engine.info(tls_client(*probe, server_name="tandem-engine")).vocab_size > 0

    frontend = make_frontend(ServerTransport(credentials=server_credentials(
        path["tandem-frontend.crt"], path["tandem-frontend.key"], path["ca.crt"])))
    stub, _ = frontend.stubs(tls_client(*as_frontend, server_name="tandem-frontend"))
    reply = frontend.call(lambda: stub.Tokenize(generation_pb2.TokenizeRequest(text="Hello there"), timeout=10))
    assert len(reply.token_ids) == 2


def test_the_node_client_reaches_the_frontend_by_its_certificate_name(make_frontend, certificates):
    """The docs' `node clients/node/chat.js --tls-ca ca.crt --tls-server-name tandem-frontend`: the
    certificate names tandem-frontend only, so the address alone does not verify."""
    node = shutil.which("node")
    if node is None or not (CHAT_JS.parent / "node_modules" / "@grpc" / "grpc-js").is_dir():
        pytest.skip("node, or clients/node's packages (make install runs npm ci), are not installed")
    frontend = make_frontend(ServerTransport(credentials=server_credentials(
        str(certificates / "tandem-frontend.crt"), str(certificates / "tandem-frontend.key"))))

    async def chat(*flags: str) -> tuple[int, str, str]:
        process = await asyncio.create_subprocess_exec(
            node, str(CHAT_JS), "--address", frontend.target.replace("127.0.0.1", "localhost"),
            "--tls-ca", str(certificates / "ca.crt"), "--max-tokens", "4", "--timeout", "20", *flags, "Hi!",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await process.communicate()  # the frontend's loop serves meanwhile
        return process.returncode, out.decode(), err.decode()

    code, out, err = frontend.run(chat("--tls-server-name", "tandem-frontend"))
    assert (code, err) == (0, "") and out.strip(), err
    code, _, err = frontend.run(chat())
    assert code == 1 and "tandem-node: UNAVAILABLE" in err and "does not match certificate" in err, err
