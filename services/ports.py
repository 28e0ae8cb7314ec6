"""A server refuses a port that is taken, before it loads anything, in one line a person can act on.

gRPC's Python server sets SO_REUSEPORT unless told otherwise, so a second stack could bind a port a
running one holds and the kernel would split connections between them. Every Tandem gRPC server turns
it off (services/security/transport.py), so a taken port fails the bind. That failure comes late
(tandem-engine binds after loading its model) and says only "Failed to bind", so each command also
probes its ports as it starts: a plain bind with SO_REUSEADDR, as gRPC's own (a closed connection's
TIME_WAIT does not count as taken; a listener does).
"""

from __future__ import annotations

import errno
import socket


class PortUnavailable(ValueError):
    """A port a server cannot listen on; str() is one line that names the address."""


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def ensure_can_listen(host: str, port: int | None, flag: str = "--port") -> None:
    """Raise PortUnavailable when `host:port` cannot be bound now: taken (`flag` picks another), or not an
    address of this machine. None (no server) and 0 (the OS picks a free port) always pass."""
    if not port:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortUnavailable(f"cannot listen on {format_address(host, port)}: {exc.strerror}") from None
    failures = []
    for family, kind, proto, _, sockaddr in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(sockaddr)
        except OSError as exc:
            failures.append(exc)
    # as gRPC: a name with several addresses (localhost: ::1 and 127.0.0.1) is served if one binds,
    # but one of them taken by another server is refused
    taken = [exc for exc in failures if exc.errno == errno.EADDRINUSE]
    if taken or (failures and len(failures) == len(addresses)):
        raise port_unavailable(host, port, flag, (taken or failures)[0])


def explain_bind_failure(host: str, port: int, flag: str, failure: object) -> PortUnavailable:
    """What to say when a server's own bind failed (gRPC says only "Failed to bind to address ...")."""
    try:
        ensure_can_listen(host, port, flag)
    except PortUnavailable as exc:
        return exc
    return PortUnavailable(f"cannot listen on {format_address(host, port)}: {failure}")


def port_unavailable(host: str, port: int, flag: str, exc: OSError) -> PortUnavailable:
    """The one line for a bind of `host:port` that failed with `exc`."""
    address = format_address(host, port)
    if exc.errno == errno.EADDRINUSE:
        return PortUnavailable(f"{address} is in use (by another tandem?); {flag} picks another port")
    return PortUnavailable(f"cannot listen on {address}: {exc.strerror or exc}")
