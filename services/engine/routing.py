"""Which connection each engine request belongs to, and the messages sent to the connections' sinks.

Every admitted request gets a fresh engine id, so connections (frontends) may use the same
request ids; outputs find their way back through `engine id -> (connection, request id)`.
That entry lives until the engine reports the request finished, so a client's abort still shows
up among its finished ids; `(connection, request id) -> engine id` holds only what the connection
has in flight, for its aborts and for refusing a duplicate id. Owned by the busy-loop thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

from engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineState,
    FinishReason,
    KVCacheEvents,
    RequestError,
    RequestErrorKind,
    SchedulerStats,
    UtilityResult,
)

Sink = Callable[[object], None]  # called from the busy-loop thread; must not block


class ConnectionRouter:
    def __init__(self) -> None:
        self.sinks: dict[int, Sink] = {}
        self._owners: dict[str, tuple[int, str]] = {}  # engine id -> (connection, request id)
        self._in_flight: dict[int, dict[str, str]] = {}  # connection -> request id -> engine id
        self._engine_ids = itertools.count()

    # ---- connections ----------------------------------------------------------------
    def open(self, connection: int, sink: Sink) -> None:
        self.sinks[connection] = sink
        self._in_flight[connection] = {}

    def is_open(self, connection: int) -> bool:
        return connection in self.sinks

    def close(self, connection: int) -> list[str]:
        """Forget the connection; returns the engine ids of its requests in flight (to abort)."""
        self.sinks.pop(connection, None)
        engine_ids = list(self._in_flight.pop(connection, {}).values())
        for engine_id in engine_ids:
            del self._owners[engine_id]  # nobody is left to tell
        return engine_ids

    def send(self, connection: int, item) -> None:
        sink = self.sinks.get(connection)
        if sink is not None:
            sink(item)

    def refuse(self, connection: int, request_id: str, message: str,
               kind: RequestErrorKind = RequestErrorKind.INVALID) -> None:
        self.send(connection, EngineCoreOutputs(errors=[RequestError(request_id, message, kind)],
                                                timestamp=time.time()))

    def reply(self, connection: int, result: UtilityResult) -> None:
        self.send(connection, EngineCoreOutputs(utility_result=result, timestamp=time.time()))

    def send_snapshot(self, connection: int, events: KVCacheEvents, stats: SchedulerStats,
                      state: EngineState | None = None) -> None:
        """A new connection's first message: the whole prefix cache and the load now (no step counters)."""
        gauges = SchedulerStats(num_running_reqs=stats.num_running_reqs, num_waiting_reqs=stats.num_waiting_reqs,
                                kv_cache_usage=stats.kv_cache_usage, num_free_blocks=stats.num_free_blocks,
                                num_total_blocks=stats.num_total_blocks)
        self.send(connection, EngineCoreOutputs(scheduler_stats=gauges, timestamp=time.time(), kv_events=events,
                                                engine_state=state))

    def broadcast_kv_events(self, events: KVCacheEvents, stats: SchedulerStats | None = None) -> None:
        """Prefix-cache changes made between steps (a reset) to every connection."""
        for connection in list(self.sinks):
            self.send(connection, EngineCoreOutputs(scheduler_stats=stats, timestamp=time.time(), kv_events=events))

    def send_state(self, connection: int, state: EngineState) -> None:
        self.send(connection, EngineCoreOutputs(timestamp=time.time(), engine_state=state))

    def broadcast_state(self, state: EngineState) -> None:
        """The engine's new state to every connection: each frontend routes and reports health by it."""
        for connection in list(self.sinks):
            self.send_state(connection, state)

    def send_aborted(self, connection: int, request_ids: list[str], stats: SchedulerStats) -> None:
        """An ABORT finish for requests the server aborted (PAUSE ABORT): their clients do not know yet."""
        outputs = [EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT) for request_id in request_ids]
        self.send(connection, EngineCoreOutputs(outputs, set(request_ids), stats, time.time()))

    # ---- requests ---------------------------------------------------------------------
    def assign(self, connection: int, request_id: str) -> str:
        """A fresh engine id for a connection's request; ValueError if it has one with that id in flight."""
        in_flight = self._in_flight[connection]
        if request_id in in_flight:
            raise ValueError(f"request id {request_id!r} is already in flight")
        engine_id = str(next(self._engine_ids))
        in_flight[request_id] = engine_id
        self._owners[engine_id] = (connection, request_id)
        return engine_id

    def forget(self, engine_id: str) -> None:
        """Undo `assign` (the engine refused the request)."""
        connection, request_id = self._owners.pop(engine_id)
        del self._in_flight[connection][request_id]

    def release(self, connection: int, request_ids: list[str]) -> list[str]:
        """The engine ids of a connection's requests it aborts (unknown ids are skipped)."""
        in_flight = self._in_flight.get(connection, {})
        return [in_flight.pop(request_id) for request_id in dict.fromkeys(request_ids) if request_id in in_flight]

    def release_all(self) -> dict[int, dict[str, str]]:
        """Every request in flight, per connection (request id -> engine id), forgotten here:
        the caller aborts them and tells each connection itself."""
        released = {connection: ids for connection, ids in self._in_flight.items() if ids}
        for ids in released.values():
            for engine_id in ids.values():
                del self._owners[engine_id]
        self._in_flight = {connection: {} for connection in self._in_flight}
        return released

    # ---- outputs ----------------------------------------------------------------------
    def route(self, step: EngineCoreOutputs) -> None:
        """Send one message to each connection with outputs or finished requests in this step, in its own ids;
        when the prefix cache changed, every connection gets a message with the changes (and the stats)."""
        messages: dict[int, EngineCoreOutputs] = {}
        if step.kv_events is not None:
            messages = {connection: EngineCoreOutputs(scheduler_stats=step.scheduler_stats, timestamp=step.timestamp,
                                                      kv_events=step.kv_events) for connection in self.sinks}

        def message_for(engine_id: str) -> tuple[EngineCoreOutputs | None, str]:
            owner = self._owners.get(engine_id)
            if owner is None:  # its connection closed, or PAUSE ABORT already reported it
                return None, ""
            connection, request_id = owner
            if connection not in messages:
                messages[connection] = EngineCoreOutputs(scheduler_stats=step.scheduler_stats, timestamp=step.timestamp)
            return messages[connection], request_id

        for output in step.outputs:
            message, request_id = message_for(output.request_id)
            if message is not None:
                message.outputs.append(dataclasses.replace(output, request_id=request_id))
        for engine_id in step.finished_request_ids:
            message, request_id = message_for(engine_id)
            if message is not None:
                message.finished_request_ids.add(request_id)
                self._finish(engine_id)
        for connection, message in messages.items():
            self.send(connection, message)

    def _finish(self, engine_id: str) -> None:
        connection, request_id = self._owners.pop(engine_id)
        in_flight = self._in_flight.get(connection, {})
        if in_flight.get(request_id) == engine_id:
            del in_flight[request_id]
