"""How a client reaches a server: address, TLS (server-verified or mutual) and the retry policy.

Retries use gRPC's own retry machinery (the channel's service config): only UNAVAILABLE is
retried, with exponential backoff, and gRPC commits a call as soon as the server's first
response arrives, so a stream that has begun is never retried; it fails instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grpc

DEFAULT_ADDRESS = "localhost:50051"
MAX_ATTEMPTS = 5  # gRPC caps maxAttempts at 5


@dataclass(frozen=True)
class TlsConfig:
    """TLS for the channel. All fields optional: TlsConfig() verifies the server against the system roots.

    root_ca: PEM file (or bytes) of the CA that signed the server's certificate.
    client_cert / client_key: PEM files (or bytes) for mutual TLS.
    server_name: the name to check the server's certificate against (when it differs from the host).
    """

    root_ca: str | Path | bytes | None = None
    client_cert: str | Path | bytes | None = None
    client_key: str | Path | bytes | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("mutual TLS needs both a client certificate and its key")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.root_ca, "root CA"),
            private_key=_read(self.client_key, "client key"),
            certificate_chain=_read(self.client_cert, "client certificate"),
        )


@dataclass(frozen=True)
class RetryPolicy:
    """Retry UNAVAILABLE before any response arrived: up to `retries` more attempts, backoff doubling."""

    retries: int = 3
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    multiplier: float = 2.0

    def service_config(self) -> str:
        if not 0 <= self.retries < MAX_ATTEMPTS:
            raise ValueError(f"retries must be in [0, {MAX_ATTEMPTS - 1}], got {self.retries}")
        services = ("tandem.v1.GenerationService", "tandem.v1.AdminService", "grpc.health.v1.Health")
        config = {"methodConfig": [{"name": [{"service": service} for service in services]}]}
        if self.retries:
            config["methodConfig"][0]["retryPolicy"] = {
                "maxAttempts": self.retries + 1,
                "initialBackoff": f"{self.initial_backoff_s}s",
                "maxBackoff": f"{self.max_backoff_s}s",
                "backoffMultiplier": self.multiplier,
                "retryableStatusCodes": ["UNAVAILABLE"],
            }
        return json.dumps(config)


def channel_options(tls: TlsConfig | None, retry: RetryPolicy) -> list[tuple[str, object]]:
    options: list[tuple[str, object]] = [
        ("grpc.enable_retries", 1 if retry.retries else 0),
        ("grpc.service_config", retry.service_config()),
        ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ]
    if tls is not None and tls.server_name:
        options.append(("grpc.ssl_target_name_override", tls.server_name))
    return options


def open_channel(address: str, tls: TlsConfig | None, retry: RetryPolicy) -> grpc.Channel:
    options = channel_options(tls, retry)
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.credentials(), options=options)


def open_aio_channel(address: str, tls: TlsConfig | None, retry: RetryPolicy) -> grpc.aio.Channel:
    options = channel_options(tls, retry)
    if tls is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """`authorization: Bearer <token>`, or nothing without a token."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def call_metadata(default: tuple[tuple[str, str], ...], metadata, traceparent: str | None) -> tuple | None:
    """The channel's default metadata, then this call's, then `traceparent` (W3C trace context)."""
    items = list(default)
    if metadata:
        items.extend(metadata.items() if hasattr(metadata, "items") else metadata)
    if traceparent:
        items.append(("traceparent", traceparent))
    return tuple((k.lower(), v) for k, v in items) or None


def _read(value: str | Path | bytes | None, what: str) -> bytes | None:
    if value is None or isinstance(value, bytes):
        return value
    try:
        return Path(value).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {str(value)!r}: {e.strerror}") from None
