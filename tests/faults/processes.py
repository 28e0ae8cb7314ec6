"""The two services as real processes on loopback, with handles to hurt them.

An engine core and any number of frontends on OS-picked ports; each can be killed
(SIGKILL), stopped (SIGTERM), restarted on the same port, and its peak RSS read.
`stop()` always ends every process, even after a failed test.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from clients.local_stack import free_port, wait_until_serving
from services.ports import PortUnavailable, ensure_can_listen
from tests.waits import STARTUP_TIMEOUT_S

ENGINE_STARTUP_S = FRONTEND_STARTUP_S = STARTUP_TIMEOUT_S  # tests/waits.py


class Service:
    """One `python -m services.<module>` process listening on a fixed loopback port."""

    def __init__(self, name: str, module: str, port: int, flags: list[str]) -> None:
        self.name, self.module, self.port, self.flags = name, module, port, flags
        self.process: subprocess.Popen | None = None
        self.peak_rss_mib: float | None = None  # the highest VmHWM seen across this service's processes

    address = property(lambda self: f"127.0.0.1:{self.port}")

    def start(self, timeout: float) -> Service:
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module, "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "WARNING", *self.flags],
            stdout=subprocess.DEVNULL,
        )
        wait_until_serving(self.address, timeout, self.process)
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def rss_mib(self) -> float | None:
        """Current RSS (also folds the peak into peak_rss_mib); None when not running or not on Linux."""
        if not self.running:
            return None
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        fields = {line.split(":")[0]: line.split()[1] for line in status.splitlines() if line.startswith("Vm")}
        peak = int(fields.get("VmHWM", 0)) / 1024
        self.peak_rss_mib = max(peak, self.peak_rss_mib or 0.0)
        return int(fields.get("VmRSS", 0)) / 1024

    def signal(self, signum: int) -> None:
        self.rss_mib()
        self.process.send_signal(signum)

    def kill(self) -> None:
        """SIGKILL and reap."""
        self.signal(signal.SIGKILL)
        self.process.wait()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (a graceful drain) and wait; the exit code."""
        self.signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def stop(self) -> None:
        if not self.running:
            return
        self.rss_mib()
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class FaultStack:
    """One engine core and the frontends connected to it."""

    def __init__(self, engine_flags: list[str], tokenizer: str) -> None:
        self.tokenizer = tokenizer
        self.engine = Service("engine", "services.engine", free_port(), engine_flags)
        self.frontends: list[Service] = []
        try:
            self.engine.start(ENGINE_STARTUP_S)
        except BaseException:
            self.stop()
            raise

    def add_frontend(self, *flags: str, name: str = "frontend") -> Service:
        """A new frontend process connected to this engine, SERVING when returned."""
        frontend = Service(name, "services.frontend", free_port(),
                           ["--engine", self.engine.address, "--tokenizer", self.tokenizer, "--grace", "30", *flags])
        self.frontends.append(frontend)
        return frontend.start(FRONTEND_STARTUP_S)

    def restart_engine(self) -> None:
        """Start the engine again on its port (after a kill or a drain), once the port is free: a SIGKILLed
        tandem-engine's gRPC server process notices its engine died and exits a moment later (on a loaded
        machine, seconds), and until then it holds the port, which a new engine refuses to share."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                ensure_can_listen("127.0.0.1", self.engine.port)
                break
            except PortUnavailable:
                assert time.monotonic() < deadline, f"{self.engine.address} stayed taken after its engine ended"
                time.sleep(0.05)
        self.engine.start(ENGINE_STARTUP_S)

    def ensure_engine_serving(self) -> None:
        """The engine running (started again if an earlier test killed or drained it: tests share the stack, and
        make test-shake repeats them in any order), and every frontend SERVING on it."""
        if not self.engine.running:
            self.restart_engine()
        for frontend in self.frontends:
            wait_until_serving(frontend.address, FRONTEND_STARTUP_S, frontend.process)

    def services(self) -> list[Service]:
        return [self.engine, *self.frontends]

    def stop(self) -> None:
        for service in reversed(self.services()):
            service.stop()
