"""A connection's bounded output buffer: busy-loop thread -> the Connect handler's event loop.

A frontend that stops reading (stalled, SIGSTOPped, a slow network) must not make the
engine buffer without bound. Outputs wait here while the gRPC write is blocked by flow
control; when more than `limit` messages wait, the outbox overflows: what it holds is
dropped, `on_overflow()` runs once (the server closes the connection, so the busy loop
aborts its requests and frees their KV blocks), and the handler's next `get()` returns
an `Overflowed` marker so the stream ends with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_PENDING_OUTPUTS = 1024


@dataclass(frozen=True)
class Overflowed:
    limit: int

    @property
    def message(self) -> str:
        return (f"the client did not read the engine's outputs: more than {self.limit} messages were waiting "
                "(--max-pending-outputs); the connection was closed and its requests were aborted")


class ConnectionOutbox:
    def __init__(self, limit: int, on_overflow: Callable[[], None]) -> None:
        if limit < 1:
            raise ValueError(f"max pending outputs must be >= 1, got {limit}")
        self.limit = limit
        self._on_overflow = on_overflow
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self.overflowed = False

    def put_threadsafe(self, item) -> None:
        """From any thread (the busy loop)."""
        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            self._loop.call_soon_threadsafe(self.put, item)

    def put(self, item) -> None:
        """From the event loop thread."""
        if self.overflowed:
            return
        if self._queue.qsize() >= self.limit:
            self.overflowed = True
            while not self._queue.empty():
                self._queue.get_nowait()
            self._queue.put_nowait(Overflowed(self.limit))
            self._on_overflow()
            return
        self._queue.put_nowait(item)

    def put_final(self, item) -> None:
        """An end-of-stream marker from the event loop thread; never dropped, never counted."""
        self._queue.put_nowait(item)

    async def get(self):
        return await self._queue.get()
