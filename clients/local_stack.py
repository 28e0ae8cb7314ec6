"""Start an engine core and a frontend as two local processes, wait until both serve, stop them.

Used by `tandem serve` and by the `make run` demo. Each service runs exactly as it
would on its own (`python -m services.engine`, `python -m services.frontend`), so
this is the two-service stack, not an in-process shortcut.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS says is free right now (for local demos and tests)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_until_serving(address: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    """Poll grpc.health.v1 until the server says SERVING; raise with a clear reason otherwise."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"the server for {address} exited with code {process.returncode} before serving")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} did not report SERVING within {timeout:.0f} s")


@dataclass
class LocalStack:
    host: str = "127.0.0.1"
    frontend_port: int = 50051
    engine_port: int = 50061
    engine_args: list[str] = field(default_factory=list)  # extra flags for tandem-engine
    frontend_args: list[str] = field(default_factory=list)  # extra flags for tandem-frontend
    startup_timeout: float = 180.0
    _processes: list[subprocess.Popen] = field(default_factory=list, init=False)

    @property
    def frontend_address(self) -> str:
        return f"{self.host}:{self.frontend_port}"

    @property
    def engine_address(self) -> str:
        return f"{self.host}:{self.engine_port}"

    @property
    def pids(self) -> list[int]:
        """Process ids of the running services (engine first)."""
        return [process.pid for process in self._processes]

    def start(self) -> "LocalStack":
        try:
            engine = self._spawn("services.engine", "--host", self.host, "--port", str(self.engine_port),
                                 *self.engine_args)
            wait_until_serving(self.engine_address, self.startup_timeout, engine)
            frontend = self._spawn("services.frontend", "--engine", self.engine_address, "--host", self.host,
                                   "--port", str(self.frontend_port), *self.frontend_args)
            wait_until_serving(self.frontend_address, self.startup_timeout, frontend)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, module: str, *args: str) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-m", module, *args])
        self._processes.append(process)
        return process

    def wait(self) -> int:
        """Block until either service exits; returns its exit code."""
        while True:
            for process in self._processes:
                if process.poll() is not None:
                    return process.returncode
            time.sleep(0.5)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the frontend first (it drains), then the engine; SIGKILL what lingers."""
        for process in reversed(self._processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._processes.clear()

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
