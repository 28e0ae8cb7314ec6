"""The engine process's threads: the model steps on the main thread, gRPC I/O beside it.

torch's OpenMP work started from a thread other than the main one runs 1.4-1.65x slower on
these CPUs (ATen's parallel elementwise ops; measured in shared/ANCHORS.md and by
scripts/bench_engine.py), so the busy loop must step where torch runs at full speed. As vLLM's
EngineCoreProc does, the busy loop owns the process's main thread and the I/O (here the
grpc.aio server, its health watchdog and the /metrics server) runs on a background thread
with its own asyncio event loop, at a CPU priority of its own (`io_cpu_priority`,
services/cpu_priority.py: at idle its wake-ups for each step's outputs no longer preempt the
step's OpenMP team, but each output waits for a free core, about one decode step; normal by
default). Both `tandem-engine` and `tandem serve` (which starts
`tandem-engine` processes) run through `serve_on_main_thread`; the in-process transport
(InProcessEngineClient) and `make bench` run through `run_beside_engine`, the same split.

Shutdown: SIGTERM / SIGINT reach the main thread (Python runs signal handlers only there,
between bytecodes, so at the latest after the step in progress) and set the I/O loop's stop
event; the I/O thread drains (`EngineServer.stop`), which stops the busy loop; `run()` returns
on the main thread, which then waits for the I/O thread to finish. If the busy loop crashes,
the server stays up answering NOT_SERVING / UNAVAILABLE until it is told to stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Awaitable, Callable, TypeVar

from services.cpu_priority import lower_cpu_priority
from services.engine.server import EngineServer

logger = logging.getLogger(__name__)
T = TypeVar("T")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class _IoThread:
    """Runs the server's gRPC side on an asyncio loop in a thread of its own until `request_stop()`."""

    def __init__(self, server: EngineServer, grace: float, cpu_priority: str) -> None:
        self.cpu_priority = cpu_priority
        self.thread = threading.Thread(target=self._run, name="engine-grpc-io", daemon=True)
        self.server = server
        self.grace = grace
        self.port: int | None = None
        self.error: BaseException | None = None
        self._listening = threading.Event()  # set once listening, or once starting failed
        self._lock = threading.RLock()  # orders request_stop() against the loop's start (re-entered by a signal)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stop_requested = False

    def start(self) -> None:
        self.thread.start()

    def join(self) -> None:
        self.thread.join()

    def _run(self) -> None:
        lower_cpu_priority(self.cpu_priority, whole_process=False)  # gRPC's threads, started from here, inherit it
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        with self._lock:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            if self._stop_requested:
                self._stop.set()
        try:
            self.port = await self.server.start(start_busy_loop=False)
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread by wait_listening()
            self.error = exc
            await self.server.stop(0)
            return
        finally:
            self._listening.set()
        await self._stop.wait()
        logger.info("shutting down (grace %.1f s)", self.grace)
        await self.server.stop(self.grace)

    def wait_listening(self) -> int:
        """The bound port; re-raises what made starting fail."""
        self._listening.wait()
        if self.error is not None:
            raise self.error
        return self.port

    def request_stop(self) -> None:
        """Thread-safe, idempotent, and safe from a signal handler."""
        with self._lock:
            self._stop_requested = True
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._stop.set)


def serve_on_main_thread(server: EngineServer, grace: float, on_listening: Callable[[int], None],
                         io_cpu_priority: str = "normal") -> None:
    """Serve until SIGTERM / SIGINT, stepping the engine on this thread (which must be the main one).

    `on_listening(port)` is called once the gRPC server listens; the I/O thread runs at
    `io_cpu_priority` (services/cpu_priority.py). Raises what made starting fail (e.g. the
    address is taken). Returns after a graceful drain.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("serve_on_main_thread must run on the main thread: the engine steps there")
    io = _IoThread(server, grace, io_cpu_priority)
    previous = {signum: signal.signal(signum, lambda *_: io.request_stop()) for signum in _STOP_SIGNALS}
    try:
        io.start()
        on_listening(io.wait_listening())
        server.busy_loop.run()  # until the I/O side's stop() ends it, or it crashes
        io.join()
    finally:
        io.request_stop()
        io.join()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run_beside_engine(busy_loop, main: Callable[[], Awaitable[T]], io_cpu_priority: str = "normal") -> T:
    """Run `main()` on an asyncio loop in a background thread while this (the main) thread steps the engine.

    The in-process transport's counterpart of `serve_on_main_thread`: a frontend (AsyncLLM over
    InProcessEngineClient) and whatever drives it run on the background loop, the busy loop runs here
    until `main()` returns (or raises), then stops. The background thread runs at `io_cpu_priority`, as
    `serve_on_main_thread`'s does. Returns what `main()` returned; re-raises what it raised.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("run_beside_engine must run on the main thread: the engine steps there")
    outcome: dict[str, object] = {}

    def io() -> None:
        lower_cpu_priority(io_cpu_priority, whole_process=False)
        try:
            outcome["value"] = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread below
            outcome["error"] = exc
        finally:
            busy_loop.stop(timeout=0)  # ends run() below; it is not ours to wait for

    thread = threading.Thread(target=io, name="in-process-io", daemon=True)
    thread.start()
    busy_loop.run()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
