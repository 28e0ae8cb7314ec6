"""The interface the engine's gRPC service and the in-process engine client drive a busy loop through, in this
process or across the socket pair.

Two classes implement it: `EngineBusyLoop` (busy_loop.py), which owns the EngineCore and steps it, and
`RemoteBusyLoop` (socket_pair.py), the same loop seen from the gRPC server process across the socket pair. A
`tests/services` check holds both to it.

A connection is one frontend stream: `open(sink)` registers it and returns its id; every item for that
connection goes in with `submit` (`busy_loop_items.Add`, `busy_loop_items.Abort`, a protocol `UtilityCall`),
and its outputs come back through `sink` (a protocol `EngineCoreOutputs`, or `busy_loop_items.EngineDied`),
called on the loop's side, never blocking. `close` aborts whatever the connection still has in flight. Request
ids are the connection's own: the loop maps them to engine ids (services/engine/routing.py), so two streams may
use the same id. docs/request-lifecycle.md tells the whole path.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable


@runtime_checkable
class BusyLoop(Protocol):
    error: str | None  # why the loop died; None while it runs

    def open(self, sink: Callable[[object], None]) -> int:
        """Register a connection; `sink(item)` gets its outputs (an `EngineDied` at once if the loop is dead)."""

    def submit(self, connection: int, item: object) -> None:
        """Queue an input for the loop: an Add, an Abort or a UtilityCall."""

    def close(self, connection: int) -> None:
        """The connection went away: abort its requests and forget it."""

    def stop(self, timeout: float = 10.0) -> None:
        """End the loop."""

    @property
    def alive(self) -> bool:
        """Not crashed and not stopped."""

    def stalled(self, timeout: float) -> bool:
        """Working, but no step completed for `timeout` seconds (the health watchdog's question)."""
