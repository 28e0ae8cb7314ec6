"""TLS and mutual TLS on the engine core and the frontend, with certificates made in the test."""

from __future__ import annotations

import argparse

import grpc
import pytest
from tandem.v1 import generation_pb2

from services.security import flags
from services.security.tls import TlsError, channel_credentials, read_pem, server_credentials
from services.security.transport import ChannelTransport, ServerTransport
from tests.security.conftest import tls_client

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


def tls_server(pki, *, client_ca=None) -> ServerTransport:
    return ServerTransport(credentials=server_credentials(pki.server_cert, pki.server_key, client_ca))


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code()


# ---- loading certificates ------------------------------------------------------------------
def test_missing_unreadable_and_wrong_files_name_the_flag(pki, tmp_path):
    with pytest.raises(TlsError, match=r"--tls-cert: .*nope.pem does not exist"):
        server_credentials(tmp_path / "nope.pem", pki.server_key)
    with pytest.raises(TlsError, match=r"--tls-key: cannot read .*"):
        server_credentials(pki.server_cert, tmp_path)  # a folder, not a file
    with pytest.raises(TlsError, match=r"--tls-key: .*server.pem is not a PEM private key"):
        server_credentials(pki.server_cert, pki.server_cert)  # cert and key swapped
    with pytest.raises(TlsError, match=r"--tls-client-ca: .*server-key.pem is not a PEM certificate"):
        server_credentials(pki.server_cert, pki.server_key, pki.server_key)
    with pytest.raises(TlsError, match="--tls-cert and --tls-key go together"):
        channel_credentials(pki.ca, cert=pki.client_cert)
    assert read_pem(pki.ca, "--tls-ca").startswith(b"-----BEGIN CERTIFICATE-----")


def test_flags_build_plaintext_by_default_and_check_pairs(pki):
    parser = argparse.ArgumentParser()
    flags.add_server_flags(parser, max_message_bytes=1000, tokens=True)
    flags.add_engine_link_flags(parser)
    plain = parser.parse_args([])
    assert flags.server_transport_from_args(plain) == ServerTransport(max_message_bytes=1000)
    assert flags.engine_link_from_args(plain).credentials is None
    with pytest.raises(TlsError, match="--tls-key is missing"):
        flags.server_transport_from_args(parser.parse_args(["--tls-cert", str(pki.server_cert)]))
    with pytest.raises(TlsError, match="--tls-cert is missing"):
        flags.server_transport_from_args(parser.parse_args(["--tls-client-ca", str(pki.ca)]))
    with pytest.raises(TlsError, match="--engine-tls-cert and --engine-tls-key go together"):
        flags.engine_link_from_args(parser.parse_args(["--engine-tls-key", str(pki.client_key)]))
    mtls = parser.parse_args(["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                              "--tls-client-ca", str(pki.ca), "--engine-tls-ca", str(pki.ca),
                              "--engine-tls-server-name", "localhost"])
    assert flags.server_transport_from_args(mtls).secure
    link = flags.engine_link_from_args(mtls)
    assert link.credentials is not None and ("grpc.ssl_target_name_override", "localhost") in link.options
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-message-bytes", "0"])


# ---- the engine core -----------------------------------------------------------------------
def test_engine_tls_needs_the_ca(make_engine, pki):
    engine = make_engine(tls_server(pki))
    assert engine.info(tls_client(pki.ca)).block_size > 0
    assert engine.info(tls_client(pki.ca, server_name="localhost")).block_size > 0
    assert code_of(lambda: engine.info(ChannelTransport(), timeout=3)) == grpc.StatusCode.UNAVAILABLE
    assert code_of(lambda: engine.info(tls_client(pki.rogue_ca), timeout=3)) == grpc.StatusCode.UNAVAILABLE


def test_engine_mutual_tls_rejects_clients_without_a_good_certificate(make_engine, pki):
    engine = make_engine(tls_server(pki, client_ca=pki.ca))
    assert engine.info(tls_client(pki.ca, pki.client_cert, pki.client_key)).vocab_size == 256
    no_cert = tls_client(pki.ca)
    rogue_cert = tls_client(pki.ca, pki.rogue_client_cert, pki.rogue_client_key)
    assert code_of(lambda: engine.info(no_cert, timeout=3)) == grpc.StatusCode.UNAVAILABLE
    assert code_of(lambda: engine.info(rogue_cert, timeout=3)) == grpc.StatusCode.UNAVAILABLE


# ---- the frontend ----------------------------------------------------------------------------
def test_frontend_tls_and_mutual_tls(make_frontend, pki):
    tokenize = generation_pb2.TokenizeRequest(text="Hello there")
    tls = make_frontend(tls_server(pki))
    stub, _ = tls.stubs(tls_client(pki.ca))
    assert len(tls.call(lambda: stub.Tokenize(tokenize)).token_ids) == 2
    plain, _ = tls.stubs(ChannelTransport())
    assert code_of(lambda: tls.call(lambda: plain.Tokenize(tokenize, timeout=3))) == UNAVAILABLE

    mtls = make_frontend(tls_server(pki, client_ca=pki.ca))
    with_cert, _ = mtls.stubs(tls_client(pki.ca, pki.client_cert, pki.client_key))
    assert len(mtls.call(lambda: with_cert.Tokenize(tokenize)).token_ids) == 2
    without_cert, _ = mtls.stubs(tls_client(pki.ca))
    assert code_of(lambda: mtls.call(lambda: without_cert.Tokenize(tokenize, timeout=3))) == UNAVAILABLE
