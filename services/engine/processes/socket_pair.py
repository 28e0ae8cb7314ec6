"""The socket pair between `tandem-engine`'s two processes, the engine process and the server process, and its
two ends.

CPython lets one thread run Python at a time (the GIL). With the gRPC server on a thread of the
engine's own process, every output woke that thread inside the step's critical path: the main
thread, having released the GIL to write the wake-up byte, waited for the I/O thread's asyncio and
gRPC work on each token (docs/cpu-tuning.md#two-processes-per-engine), and the I/O thread's later
wake-ups took the GIL between the step's kernels. So the gRPC server runs in a process of its own
(server_process.py) and the two talk over one Unix socket pair: the model's main thread pickles each
connection's outputs and writes them (no other thread of its process wants the GIL meanwhile), the
server process does everything gRPC.

Frames: a 4-byte little-endian length, then a pickle of a tuple whose first item names it.
Both ends are our own processes, started together; nothing else can reach the socket pair.

  server process -> engine process        engine process -> server process
    ("open", connection)                    ("info", GetEngineInfoResponse bytes)
    ("submit", connection, item)            ("out", connection, item)   a sink's item
    ("close", connection)                   ("status", heartbeat, busy, error, alive)
    ("listening", port) | ("failed", why)   ("shutdown", grace)  SIGTERM / SIGINT reached the engine
    ("stop",)  the busy loop may end

`EngineEnd` is the engine process's end: it opens busy-loop connections for the server's, and
every `STATUS_PERIOD_S` sends the loop's health. `RemoteBusyLoop` is the server process's end: the
part of `EngineBusyLoop`'s interface the gRPC server uses (open / submit / close / stop, alive,
stalled, error), so the server code is the same in both layouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import struct
import threading
import time
from collections import deque
from typing import Callable

from services.engine.busy_loop_items import EngineDied, Open

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
STATUS_PERIOD_S = 0.1  # the engine's health reaches the server at least this often
SOCKET_BUFFER_BYTES = 4 << 20


def encode(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into decoded messages."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + length
            if len(self._buffer) < end:
                break
            messages.append(pickle.loads(self._buffer[_HEADER.size:end]))
            del self._buffer[:end]
        return messages


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(the engine's end, the server process's end), with room for bursts of outputs."""
    pair = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in pair:
        end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    return pair


# ---- the engine process's end ----------------------------------------------------------------
class EngineEnd:
    """Serves the server process's connections from `busy_loop`, which steps on the main thread.

    A reader thread turns the server's frames into busy-loop inputs; each connection's sink (called
    on the stepping thread) writes its items back. `listening` resolves with the server's port.
    """

    def __init__(self, busy_loop, sock: socket.socket) -> None:
        self.busy_loop = busy_loop
        self._sock = sock
        self._send_lock = threading.Lock()
        self._connections: dict[int, int] = {}  # the server's connection id -> the busy loop's
        self._listening = threading.Event()
        self.port: int | None = None
        self.failure: str | None = None  # why the server process could not listen, or ended early
        self._closed = threading.Event()
        self._wake = threading.Event()  # the status thread's: a shutdown to send, or closing
        self._shutdown_grace: float | None = None
        self._threads: list[threading.Thread] = []

    def start(self, info: bytes) -> None:
        self.send(("info", info))
        self._threads = [threading.Thread(target=self._read, name="engine-socket-reader", daemon=True),
                         threading.Thread(target=self._report_status, name="engine-socket-status", daemon=True)]
        for thread in self._threads:
            thread.start()

    def wait_listening(self) -> int:
        """The server's port; RuntimeError with the server's reason if it did not start."""
        self._listening.wait()
        if self.port is None:
            raise RuntimeError(self.failure or "the gRPC server process ended before it listened")
        return self.port

    def request_shutdown(self, grace: float) -> None:
        """Ask the server to drain (`grace` seconds) and stop; it then lets the busy loop end. Safe from a
        signal handler: the status thread sends it (a handler runs between any two bytecodes of the main
        thread, perhaps in the middle of its own `send`)."""
        if self._shutdown_grace is None:
            self._shutdown_grace = grace
        self._wake.set()

    def send(self, message: tuple) -> None:
        data = encode(message)
        with self._send_lock:
            if self._closed.is_set():
                return
            try:
                self._sock.sendall(data)
            except OSError:  # the server process is gone; the reader sees it and ends the loop
                self._closed.set()

    def close(self, timeout: float = 5.0) -> None:
        """Close the socket and wait (up to `timeout` seconds) for the reader and status threads to end.
        Joined, not left to the interpreter's exit: a thread that ends while Python finalizes and drops
        the last reference to the engine frees its tensors there, and torch's tensor free then aborted
        the process ("terminate called without an active exception", 1 exit in 3-12)."""
        with self._send_lock:
            self._closed.set()
            self._wake.set()
            with contextlib.suppress(OSError):  # wakes a recv() blocked in the reader; close() alone may not
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)

    # ---- reader thread
    def _read(self) -> None:
        frames = FrameReader()
        try:
            while data := self._sock.recv(1 << 16):
                for message in frames.feed(data):
                    self._handle(message)
        except OSError:
            pass
        finally:  # the server process ended (or closed its end): nothing can reach the engine any more
            if self.port is None:
                self.failure = self.failure or "the gRPC server process ended before it listened"
            self._listening.set()
            self._closed.set()
            self.busy_loop.stop(timeout=0)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "submit":
            self.busy_loop.submit(self._connections.get(message[1], -1), message[2])
        elif kind == "open":
            connection = message[1]
            self._connections[connection] = self.busy_loop.open(
                lambda item, connection=connection: self.send(("out", connection, item)))
        elif kind == "close":
            self.busy_loop.close(self._connections.pop(message[1], -1))
        elif kind == "listening":
            self.port = message[1]
            self._listening.set()
        elif kind == "failed":
            self.failure = message[1]
            self._listening.set()
        elif kind == "stop":
            self.busy_loop.stop(timeout=0)

    # ---- status thread
    def _report_status(self) -> None:
        loop, shutdown_sent = self.busy_loop, False
        while not self._closed.is_set():
            if self._shutdown_grace is not None and not shutdown_sent:
                self.send(("shutdown", self._shutdown_grace))
                shutdown_sent = True
            self.send(("status", loop.heartbeat, loop.busy, loop.error, loop.alive))
            self._wake.wait(STATUS_PERIOD_S)
            self._wake.clear()


# ---- the server process's end -------------------------------------------------------------------
class RemoteBusyLoop:
    """The engine's busy loop as the server process sees it (same interface as EngineBusyLoop's
    open / submit / close / stop, alive / stalled / error). Runs on the server's asyncio loop:
    `connect()` there first; sinks are called on that loop's thread."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop: asyncio.AbstractEventLoop | None = None
        self._frames = FrameReader()
        self._pending = deque()  # frames not yet written (the socket was full)
        self._waiting_to_write = False
        self._sinks: dict[int, Callable[[object], None]] = {}
        self._next_connection = 1
        self.info: bytes | None = None
        self._info_ready = asyncio.Event()
        self.shutdown_requested = asyncio.Event()
        self.shutdown_grace: float | None = None
        # the engine's health, as last reported
        self.heartbeat = time.monotonic()
        self.busy = False
        self.error: str | None = None
        self._engine_alive = True
        self.engine_gone = False  # the engine process closed its end (exited or was killed)

    async def connect(self) -> bytes:
        """Start reading; returns the engine's GetEngineInfoResponse (serialized)."""
        self._loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        self._loop.add_reader(self._sock.fileno(), self._on_readable)
        await self._info_ready.wait()
        if self.info is None:
            raise RuntimeError("the engine process ended before it sent its info")
        return self.info

    # ---- EngineBusyLoop's interface
    def open(self, sink: Callable[[object], None]) -> int:
        connection, self._next_connection = self._next_connection, self._next_connection + 1
        if self.engine_gone:  # as EngineBusyLoop answers an Open after it died
            sink(EngineDied(self.error))
            return connection
        self._sinks[connection] = sink
        self._send(("open", connection))
        return connection

    def close(self, connection: int) -> None:
        if self._sinks.pop(connection, None) is not None:
            self._send(("close", connection))

    def submit(self, connection: int, item) -> None:
        if isinstance(item, Open):
            raise TypeError("open connections with open()")
        self._send(("submit", connection, item))

    def stop(self, timeout: float = 10.0) -> None:
        """Let the engine's busy loop end (tandem-engine then exits)."""
        self._send(("stop",))

    # ---- the server process's own messages
    def report_listening(self, port: int) -> None:
        self._send(("listening", port))

    def report_failure(self, reason: str) -> None:
        self._send(("failed", reason))

    def request_shutdown(self, grace: float) -> None:
        """Drain for `grace` seconds and stop, as when the engine process forwards SIGTERM."""
        if not self.shutdown_requested.is_set():
            self.shutdown_grace = grace
            self.shutdown_requested.set()

    async def close_socket(self, timeout: float = 5.0) -> None:
        """Write what is still pending (at most `timeout` seconds), then close the socket."""
        deadline = time.monotonic() + timeout
        while self._pending and not self.engine_gone and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._loop is not None and not self.engine_gone:
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
        self._sock.close()

    @property
    def alive(self) -> bool:
        return self._engine_alive and not self.engine_gone and self.error is None

    def stalled(self, timeout: float) -> bool:
        """Working, but no step completed for `timeout` seconds (the heartbeat comes from the engine
        process every STATUS_PERIOD_S; CLOCK_MONOTONIC is the same in both processes)."""
        return self.busy and time.monotonic() - self.heartbeat > timeout

    # ---- reading
    def _on_readable(self) -> None:
        try:
            data = self._sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._engine_ended()
            return
        for message in self._frames.feed(data):
            self._handle(message)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            sink = self._sinks.get(message[1])
            if sink is not None:
                sink(message[2])
        elif kind == "status":
            self.heartbeat, self.busy, self.error, self._engine_alive = message[1:]
        elif kind == "info":
            self.info = message[1]
            self._info_ready.set()
        elif kind == "shutdown":
            self.request_shutdown(message[1])

    def _engine_ended(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        if self._waiting_to_write:
            self._loop.remove_writer(self._sock.fileno())
            self._waiting_to_write = False
        self._pending.clear()
        self.engine_gone = True
        self.error = self.error or "the engine process exited"
        for sink in list(self._sinks.values()):  # its streams end UNAVAILABLE now, not at the server's stop
            sink(EngineDied(self.error))
        self._info_ready.set()
        self.shutdown_grace = 0.0  # nothing in flight can finish now
        self.shutdown_requested.set()

    # ---- writing: never blocks the event loop; what the socket cannot take now waits in order
    def _send(self, message: tuple) -> None:
        if self.engine_gone:
            return
        self._pending.append(memoryview(encode(message)))
        if len(self._pending) == 1:
            self._flush()

    def _flush(self) -> None:
        while self._pending:
            try:
                sent = self._sock.send(self._pending[0])
            except BlockingIOError:
                break
            except OSError:
                self._engine_ended()
                return
            if sent < len(self._pending[0]):
                self._pending[0] = self._pending[0][sent:]
                break
            self._pending.popleft()
        if bool(self._pending) != self._waiting_to_write:
            self._waiting_to_write = bool(self._pending)
            if self._waiting_to_write:
                self._loop.add_writer(self._sock.fileno(), self._flush)
            else:
                self._loop.remove_writer(self._sock.fileno())
