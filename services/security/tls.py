"""TLS and mutual TLS: PEM files -> gRPC server and channel credentials.

Every loader fails early with a TlsError that names the flag and the file, so a bad path
or a swapped cert/key shows at startup, not as an opaque handshake failure later.
"""

from __future__ import annotations

from pathlib import Path

import grpc

_CERT_MARKER = b"-----BEGIN CERTIFICATE-----"
_KEY_MARKER = b"PRIVATE KEY-----"


class TlsError(ValueError):
    """A TLS file is missing, unreadable or not what its flag expects."""


def read_pem(path: str | Path, flag: str, *, kind: str = "certificate") -> bytes:
    """The bytes of a PEM file given with `flag`; kind is "certificate" or "private key"."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TlsError(f"{flag}: {path} does not exist") from None
    except OSError as exc:
        raise TlsError(f"{flag}: cannot read {path} ({exc.strerror or exc})") from None
    marker = _KEY_MARKER if kind == "private key" else _CERT_MARKER
    if marker not in data:
        raise TlsError(f"{flag}: {path} is not a PEM {kind} (no '{marker.decode().strip('-')}' block)")
    return data


def server_credentials(cert: str | Path, key: str | Path, client_ca: str | Path | None = None, *,
                       flags: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-client-ca"),
                       ) -> grpc.ServerCredentials:
    """TLS server credentials; with `client_ca`, mutual TLS: clients must present a certificate signed by it."""
    chain = read_pem(cert, flags[0])
    private_key = read_pem(key, flags[1], kind="private key")
    roots = read_pem(client_ca, flags[2]) if client_ca else None
    return grpc.ssl_server_credentials([(private_key, chain)], root_certificates=roots,
                                       require_client_auth=roots is not None)


def channel_credentials(ca: str | Path | None = None, cert: str | Path | None = None, key: str | Path | None = None,
                        *, flags: tuple[str, str, str] = ("--tls-ca", "--tls-cert", "--tls-key"),
                        ) -> grpc.ChannelCredentials:
    """TLS channel credentials: trust `ca` (None: the system's roots); `cert` + `key` for mutual TLS."""
    if (cert is None) != (key is None):
        raise TlsError(f"{flags[1]} and {flags[2]} go together: a client certificate needs its private key")
    roots = read_pem(ca, flags[0]) if ca else None
    chain = read_pem(cert, flags[1]) if cert else None
    private_key = read_pem(key, flags[2], kind="private key") if key else None
    return grpc.ssl_channel_credentials(root_certificates=roots, private_key=private_key, certificate_chain=chain)
