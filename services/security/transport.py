"""How servers listen and channels connect: plaintext or TLS, interceptors, message size limits.

A server's port is its own: SO_REUSEPORT, which gRPC's Python server sets by default, is off, so a
second server on a taken port fails to bind instead of sharing the port's connections at random
(services/ports.py turns that into one line naming the port).

A message over the limit ends its call with RESOURCE_EXHAUSTED (gRPC's own check: "received
message larger than max (N vs. M)") and the server keeps serving everyone else.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

DEFAULT_MAX_MESSAGE_BYTES = 4 << 20  # the public API's default: gRPC's own
ENGINE_LINK_MAX_MESSAGE_BYTES = 64 << 20  # the engine link carries whole batches of outputs
EXCLUSIVE_PORT_OPTION = ("grpc.so_reuseport", 0)  # a taken port fails the bind instead of being shared


def message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options that cap received and sent messages at `max_message_bytes`."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


@dataclass(frozen=True)
class ServerTransport:
    """A server's listening side: TLS credentials (None: plaintext), interceptors, message size limit."""

    credentials: grpc.ServerCredentials | None = None
    interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @property
    def secure(self) -> bool:
        return self.credentials is not None

    def server(self, *interceptors: grpc.aio.ServerInterceptor) -> grpc.aio.Server:
        """A grpc.aio server with this transport's interceptors (then `interceptors`) and limits."""
        return grpc.aio.server(interceptors=[*self.interceptors, *interceptors],
                               options=[*message_size_options(self.max_message_bytes), EXCLUSIVE_PORT_OPTION])

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind `address` (TLS when there are credentials); the port. gRPC raises RuntimeError ("Failed to
        bind") or returns 0 when it could not bind."""
        if self.credentials is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.credentials)


@dataclass(frozen=True)
class ChannelTransport:
    """A client's connecting side: TLS credentials (None: plaintext), the TLS name to verify, size limit."""

    credentials: grpc.ChannelCredentials | None = None
    server_name: str | None = None  # the name the server's certificate must carry (default: the target's host)
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @property
    def options(self) -> list[tuple[str, object]]:
        options: list[tuple[str, object]] = message_size_options(self.max_message_bytes)
        if self.server_name:
            options.append(("grpc.ssl_target_name_override", self.server_name))
        return options

    def aio_channel(self, target: str) -> grpc.aio.Channel:
        if self.credentials is None:
            return grpc.aio.insecure_channel(target, options=self.options)
        return grpc.aio.secure_channel(target, self.credentials, options=self.options)

    def channel(self, target: str) -> grpc.Channel:
        """A blocking channel (probes, scripts)."""
        if self.credentials is None:
            return grpc.insecure_channel(target, options=self.options)
        return grpc.secure_channel(target, self.credentials, options=self.options)
