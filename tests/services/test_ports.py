"""A port is one server's: gRPC and /metrics servers do not share theirs, and a taken port is refused in one line.

gRPC's Python server sets SO_REUSEPORT unless told otherwise, which let a second stack bind a running
one's ports (the kernel then split connections between them). These tests hold a port with a real
server or a plain socket and check that a second server, tandem-engine and tandem-frontend refuse it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from clients.local_stack import free_port
from services.ports import PortUnavailable, ensure_can_listen, explain_bind_failure, format_address
from services.security.transport import ServerTransport
from services.telemetry.metrics import MetricsServer
from tests.clients.conftest import REPO
from tests.event_loops import close_loop

HOST = "127.0.0.1"


@contextlib.contextmanager
def plain_listener():
    """A plain (non-gRPC) TCP socket listening on a free loopback port; yields the port."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        sock.listen()
        yield sock.getsockname()[1]


def can_join_with_so_reuseport(port: int) -> bool:
    """Whether a socket asking to share the port (SO_REUSEPORT, gRPC's old default) may bind it."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def in_use(port: int, flag: str = "--port") -> str:
    return f"{HOST}:{port} is in use (by another tandem?); {flag} picks another port"


def run_loop(coro):
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        close_loop(loop)


def test_a_grpc_server_keeps_its_port_to_itself():
    async def scenario():
        transport = ServerTransport()
        first = transport.server()
        port = transport.add_port(first, f"{HOST}:0")
        await first.start()
        second = transport.server()
        try:
            try:
                bound = transport.add_port(second, f"{HOST}:{port}")
            except RuntimeError:  # grpc: "Failed to bind to address ..."
                bound = 0
            assert bound == 0, "a second gRPC server bound a port the first one listens on"
            assert not can_join_with_so_reuseport(port)
            with pytest.raises(PortUnavailable) as refused:
                ensure_can_listen(HOST, port)
            assert str(refused.value) == in_use(port)
        finally:
            await second.stop(None)
            await first.stop(None)

    run_loop(scenario())


def test_the_metrics_server_keeps_its_port_to_itself():
    first = MetricsServer(CollectorRegistry(), HOST, 0)
    port = first.start()
    try:
        with pytest.raises(PortUnavailable) as refused:
            MetricsServer(CollectorRegistry(), HOST, port).start()
        assert str(refused.value) == in_use(port, "--metrics-port")
        assert not can_join_with_so_reuseport(port)
    finally:
        first.stop()


def test_a_port_held_by_a_plain_socket_is_refused_and_a_free_one_passes():
    with plain_listener() as port:
        with pytest.raises(PortUnavailable) as refused:
            ensure_can_listen(HOST, port, "--engine-port")
        assert str(refused.value) == in_use(port, "--engine-port")
        # after a server's own bind failed, the same line (gRPC itself says only "Failed to bind")
        assert str(explain_bind_failure(HOST, port, "--port", "Failed to bind")) == in_use(port)
    ensure_can_listen(HOST, port)  # released
    ensure_can_listen(HOST, 0)  # the OS picks
    ensure_can_listen(HOST, None)  # no server
    assert str(explain_bind_failure(HOST, port, "--port", "Failed to bind")) == \
        f"cannot listen on {HOST}:{port}: Failed to bind"


def test_an_address_of_another_machine_is_refused_with_the_reason():
    with pytest.raises(PortUnavailable, match=r"^cannot listen on 192\.0\.2\.1:50061: Cannot assign requested"):
        ensure_can_listen("192.0.2.1", 50061)  # TEST-NET-1: never an address of this machine
    assert format_address("::1", 50051) == "[::1]:50051"


@pytest.mark.parametrize("program, module, flag", [
    ("tandem-engine", "services.engine", "--port"),
    ("tandem-engine", "services.engine", "--metrics-port"),
    ("tandem-frontend", "services.frontend", "--port"),
    ("tandem-frontend", "services.frontend", "--metrics-port"),
])
def test_a_service_on_a_taken_port_exits_1_with_one_line(program, module, flag):
    with plain_listener() as port:
        ports = {"--port": free_port(), flag: port}  # the other port is free
        args = [arg for name, value in ports.items() for arg in (name, str(value))]
        # no model and no engine: the ports are looked at before either is needed
        result = subprocess.run([sys.executable, "-m", module, "--host", HOST, *args], capture_output=True,
                                text=True, timeout=60, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [f"{program}: {in_use(port, flag)}"]
    assert result.stdout == ""
