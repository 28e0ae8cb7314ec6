"""Start an engine core and a frontend as two local processes, wait until both serve, keep them up, stop them.

Used by `tandem serve` and by the `make run` demo. Each service runs exactly as it
would on its own (`python -m services.engine`, `python -m services.frontend`), so
this is the two-service stack, not an in-process shortcut. `supervise()` restarts a
service that exits on its own (a crashed engine, an OOM kill) after a capped
exponential backoff; the frontend reconnects to a restarted engine by itself.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

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


def _describe_exit(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _say(message: str) -> None:
    print(f"tandem: {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RestartPolicy:
    """How `supervise()` restarts a service that exited: after `backoff_initial_s`, doubling up to
    `backoff_max_s`; a run of `stable_s` seconds resets the backoff; after `max_restarts` runs in a row
    that each ended sooner, it gives up (a service that cannot start is not retried forever)."""

    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    stable_s: float = 60.0
    max_restarts: int = 10


class SupervisedProcess:
    """One `python -m <module> <args>` child, restarted with backoff by `check()` when it exits."""

    def __init__(self, name: str, module: str, args: list[str], policy: RestartPolicy,
                 say: Callable[[str], None]) -> None:
        self.name, self.argv = name, [sys.executable, "-m", module, *args]
        self.policy, self._say = policy, say
        self.process: subprocess.Popen | None = None
        self.restarts = 0  # in a row, each after a run shorter than policy.stable_s
        self._started_at = 0.0
        self._restart_at: float | None = None  # when the process is down and a restart is due

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def spawn(self) -> subprocess.Popen:
        self.process = subprocess.Popen(self.argv)
        self._started_at = time.monotonic()
        return self.process

    def check(self, now: float) -> bool:
        """Notice an exit and schedule the restart, or restart when it is due; False: gave up."""
        if self._restart_at is not None:
            if now >= self._restart_at:
                self._restart_at = None
                self._say(f"{self.name} restarted (pid {self.spawn().pid})")
            return True
        code = self.process.poll()
        if code is None:
            return True
        if now - self._started_at >= self.policy.stable_s:
            self.restarts = 0
        how = _describe_exit(code)
        if self.restarts >= self.policy.max_restarts:
            self._say(f"{self.name} {how}; it stopped {self.restarts + 1} times in a row within "
                      f"{self.policy.stable_s:g} s of starting, so it is not restarted again (see its log above)")
            return False
        delay = min(self.policy.backoff_initial_s * 2**self.restarts, self.policy.backoff_max_s)
        self.restarts += 1
        self._restart_at = now + delay
        self._say(f"{self.name} {how}; restarting it in {delay:.1f} s")
        return True

    def stop(self, timeout: float) -> None:
        """SIGTERM (the service drains), SIGKILL if it lingers; no restart afterwards."""
        self._restart_at = None
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class LocalStack:
    host: str = "127.0.0.1"
    frontend_port: int = 50051
    engine_port: int = 50061
    engine_args: list[str] = field(default_factory=list)  # extra flags for tandem-engine
    frontend_args: list[str] = field(default_factory=list)  # extra flags for tandem-frontend
    # The frontend shares the engine's cores here: at low (nice 19) its per-token wake-ups mostly wait for cores
    # the engine's OpenMP team leaves free instead of stalling the team (services/cpu_priority.py)
    frontend_cpu_priority: str = "low"
    startup_timeout: float = 180.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    say: Callable[[str], None] = _say  # restarts are reported through this
    _services: list[SupervisedProcess] = field(default_factory=list, init=False)

    @property
    def frontend_address(self) -> str:
        return f"{self.host}:{self.frontend_port}"

    @property
    def engine_address(self) -> str:
        return f"{self.host}:{self.engine_port}"

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the services (engine first); None for one that is down."""
        return [service.pid for service in self._services]

    def start(self) -> "LocalStack":
        try:
            engine = self._add("engine core", "services.engine", "--host", self.host,
                               "--port", str(self.engine_port), *self.engine_args)
            wait_until_serving(self.engine_address, self.startup_timeout, engine.spawn())
            frontend = self._add("frontend", "services.frontend", "--engine", self.engine_address,
                                 "--host", self.host, "--port", str(self.frontend_port),
                                 "--cpu-priority", self.frontend_cpu_priority, *self.frontend_args)
            wait_until_serving(self.frontend_address, self.startup_timeout, frontend.spawn())
        except BaseException:
            self.stop()
            raise
        return self

    def _add(self, name: str, module: str, *args: str) -> SupervisedProcess:
        service = SupervisedProcess(name, module, list(args), self.restart, self.say)
        self._services.append(service)
        return service

    def supervise(self, poll_s: float = 0.2) -> int:
        """Keep both services up, restarting one that exits; returns 1 once one cannot be kept up.
        Runs until then or until interrupted (SIGINT, or SystemExit from a SIGTERM handler)."""
        while all(service.check(time.monotonic()) for service in self._services):
            time.sleep(poll_s)
        return 1

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the frontend first (it drains), then the engine; SIGKILL what lingers."""
        for service in reversed(self._services):
            service.stop(timeout)
        self._services.clear()

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
