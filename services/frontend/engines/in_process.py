"""InProcessEngineClient: the EngineClient over an engine busy loop in this process (no gRPC, no protos).

DESIGN's second transport. AsyncLLM runs unchanged over it, so a benchmark of the split measures
the transport alone. Items cross as the engine's own dataclasses (SamplingParams, FinishReason and
TokenLogprobs are one class on both sides), through the busy loop's public surface: `open(sink)`,
`submit(connection, item)`, `close(connection)` and the items in services/engine/busy_loop_items.py.

This module never imports torch: the caller builds the busy loop (an EngineBusyLoop around an
EngineCore) and decides where it steps. `busy_loop.run()` on the process's main thread gives torch
its full speed; `busy_loop.start()` steps on a thread of its own, slower
(docs/cpu-tuning.md#two-processes-per-engine) but enough for tests and tools.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import TYPE_CHECKING

from engine_core.protocol import ControlCall, EngineCoreRequest, EngineInfo, EngineState, UtilityCall
from services.frontend.engines.client import (
    EngineCallResult,
    EngineClient,
    EngineStatus,
    with_adapter,
)
from services.frontend.errors import EngineAsleep, EngineUnavailable

if TYPE_CHECKING:
    from services.engine.processes.busy_loop_interface import BusyLoop

log = logging.getLogger(__name__)


class InProcessEngineClient(EngineClient):
    """One connection to an engine busy loop of this process; `info` describes its model."""

    def __init__(self, busy_loop: BusyLoop, info: EngineInfo, *, address: str = "in-process") -> None:
        super().__init__()
        from services.engine import busy_loop_items  # the busy loop's plain items (torch-free), only when used

        self._items = busy_loop_items
        self._busy_loop = busy_loop
        self._info = info
        self.address = address
        self._connection: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: str | None = None  # set when the busy loop died
        self._in_flight: set[str] = set()
        self._state = EngineState()  # paused or asleep, as the engine last said
        self._pending: dict[int, asyncio.Future] = {}  # utility call id -> result
        self._call_ids = itertools.count(1)

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._connection = self._busy_loop.open(self._sink)
        self._notify()

    async def close(self) -> None:
        if self._connection is not None:
            self._busy_loop.close(self._connection)
            self._connection = None
            self._lose("the in-process engine client was closed")

    async def wait_for_engine(self) -> EngineInfo:
        if not self.is_connected:
            raise EngineUnavailable(f"the in-process engine is not running ({self._error or 'not started'})")
        return self._info

    # ---- state ----------------------------------------------------------------------
    @property
    def is_connected(self) -> bool:
        return self._connection is not None and self._error is None

    @property
    def admitting(self) -> bool:
        return self.is_connected and self._state.admitting

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def engine_info(self) -> EngineInfo | None:
        return self._info if self.is_connected else None

    def engines(self) -> list[EngineStatus]:
        return [EngineStatus(self.address, self.is_connected, len(self._in_flight), self._state)]

    # ---- requests -------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        if not self.is_connected:
            raise EngineUnavailable(f"the in-process engine is not running ({self._error or 'not started'})")
        if self._state.asleep:
            raise EngineAsleep()
        self._in_flight.add(request.request_id)
        with_adapter(self.engines(), request.lora_name)  # NotFound when the engine lacks the adapter
        self._busy_loop.submit(self._connection, self._items.Add(request))

    def abort(self, request_ids: list[str]) -> None:
        ids = [request_id for request_id in request_ids if request_id in self._in_flight]
        self._in_flight.difference_update(ids)
        if ids and self.is_connected:
            self._busy_loop.submit(self._connection, self._items.Abort(ids))

    async def call_utility(self, call: ControlCall) -> list[EngineCallResult]:
        if not self.is_connected:
            raise EngineUnavailable("the in-process engine is not running; the call reached no engine")
        call_id = next(self._call_ids)
        self._pending[call_id] = future = asyncio.get_running_loop().create_future()
        self._busy_loop.submit(self._connection, UtilityCall(call_id, call))
        return [await future]

    # ---- from the busy loop's thread ------------------------------------------------
    def _sink(self, item) -> None:
        """Called on the loop thread with each output item: hop to the event loop, never block."""
        try:
            self._loop.call_soon_threadsafe(self._route, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def _route(self, item) -> None:
        """Utility answers to their callers; refusals and outputs to the output handler; a new state to the
        listeners."""
        if isinstance(item, self._items.EngineDied):
            self._error = item.error
            self._lose(f"the in-process engine died: {item.error}")
            return
        if item.engine_state is not None:
            self._state = item.engine_state
            self._notify()
        self._deliver(self.address, item, self._pending, self._in_flight.difference_update)

    def _lose(self, reason: str) -> None:
        """Every request in flight ends with UNAVAILABLE; pending utility calls fail."""
        lost = list(self._in_flight)
        self._in_flight.clear()
        self._fail_lost(self.address, lost, self._pending, EngineUnavailable(f"{reason}; retry the request"), reason)
        self._notify()


def start_engine(model: str, *, dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 256):
    """Load an EngineCore and start its busy loop on a thread of its own (imports torch here, not before).

    Returns (busy_loop, EngineInfo); `busy_loop.stop()` ends it. For tools and benchmarks that have
    no engine process: the engine steps off the main thread (see the module docstring).
    """
    from engine_core.config import EngineConfig, ModelConfig, SchedulerConfig
    from engine_core.engine_core import EngineCore
    from services.engine.busy_loop import EngineBusyLoop

    core = EngineCore(EngineConfig(model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len),
                                   scheduler=SchedulerConfig(max_num_seqs=max(max_num_seqs, 1))), log_stats=True)
    core.ready_to_serve()
    busy_loop = EngineBusyLoop(core)
    busy_loop.start()
    return busy_loop, core.info

