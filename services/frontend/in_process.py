"""InProcessEngineClient: the EngineClient over an engine busy loop in this process (no gRPC, no protos).

DESIGN's second transport. AsyncLLM runs unchanged over it, so a benchmark of the split measures
the transport alone. Items cross as the engine's own dataclasses (SamplingParams, FinishReason and
TokenLogprobs are one class on both sides), through the busy loop's public surface: `open(sink)`,
`submit(connection, item)`, `close(connection)` and the messages in services/engine/messages.py.

This module never imports torch: the caller builds the busy loop (an EngineBusyLoop around an
EngineCore) and decides where it steps. `busy_loop.run()` on the process's main thread gives torch
its full speed; `busy_loop.start()` steps on a thread of its own, 1.4-1.65x slower on these CPUs
(services/engine/process.py) but enough for tests and tools.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

from services.frontend.engine_client_base import EngineClient, refusal_error, with_adapter
from services.frontend.errors import EngineAsleep, EngineUnavailable
from services.frontend.messages import (
    EngineEvent,
    EngineEventType,
    EngineInfo,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    EngineState,
    EngineStatus,
    FinishReason,
    RequestError,
    UtilityResult,
)

log = logging.getLogger(__name__)


class InProcessEngineClient(EngineClient):
    """One connection to an engine busy loop of this process; `info` describes its model."""

    def __init__(self, busy_loop, info: EngineInfo, *, address: str = "in-process") -> None:
        super().__init__()
        from services.engine import messages  # the engine's plain messages (torch-free), only when used

        self._messages = messages
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
    def add_request(self, request: EngineRequest) -> None:
        if not self.is_connected:
            raise EngineUnavailable(f"the in-process engine is not running ({self._error or 'not started'})")
        if self._state.asleep:
            raise EngineAsleep()
        with_adapter(self.engines(), request.lora_name)  # NotFound when the engine lacks the adapter
        self._in_flight.add(request.request_id)
        self._busy_loop.submit(self._connection, self._messages.Add(_core_request(request)))

    def abort(self, request_ids: list[str]) -> None:
        ids = [request_id for request_id in request_ids if request_id in self._in_flight]
        self._in_flight.difference_update(ids)
        if ids and self.is_connected:
            self._busy_loop.submit(self._connection, self._messages.Abort(ids))

    async def call_utility(self, method: str, *, pause_mode: str = "", profile_dir: str = "", lora_name: str = "",
                           lora_path: str = "") -> list[UtilityResult]:
        if not self.is_connected:
            raise EngineUnavailable("the in-process engine is not running; the call reached no engine")
        m = self._messages
        call_id = next(self._call_ids)
        self._pending[call_id] = future = asyncio.get_running_loop().create_future()
        mode = m.PauseMode(pause_mode) if pause_mode else m.PauseMode.ABORT
        self._busy_loop.submit(self._connection, m.Utility(call_id, m.UtilityMethod(method), mode, profile_dir,
                                                           lora_name, lora_path))
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
        if isinstance(item, self._messages.EngineDied):
            self._error = item.error
            self._lose(f"the in-process engine died: {item.error}")
            return
        if item.engine_state is not None:
            core = item.engine_state
            self._state = EngineState(paused=core.paused, asleep=core.asleep,
                                      pause_mode=core.pause_mode.value if core.pause_mode else "",
                                      lora_names=core.lora_names)
            self._notify()
        if item.utility_result is not None:
            result = item.utility_result
            future = self._pending.pop(result.call_id, None)
            if future is not None and not future.done():
                kind = result.error_kind.value if result.error_kind else ""
                future.set_result(UtilityResult(self.address, result.ok, result.error, result.loras, kind))
        for error in item.errors:
            self._in_flight.discard(error.request_id)
            asleep = error.kind is self._messages.RequestErrorKind.ASLEEP
            not_found = error.kind is self._messages.RequestErrorKind.NOT_FOUND
            refused = RequestError(error.request_id, error.message, engine_asleep=asleep, not_found=not_found)
            self._put_output(EngineOutputs(failed=[error.request_id], error=refusal_error(refused)))
        outputs = _outputs_from_core(item)
        if outputs:
            self._in_flight.difference_update(o.request_id for o in outputs if o.finish_reason is not None)
            self._put_output(EngineOutputs(outputs=outputs))

    def _lose(self, reason: str) -> None:
        """Every request in flight ends with UNAVAILABLE; pending utility calls fail."""
        lost = list(self._in_flight)
        self._in_flight.clear()
        if lost:
            self._put_output(EngineOutputs(failed=lost, error=EngineUnavailable(f"{reason}; retry the request")))
        for future in self._pending.values():
            if not future.done():
                future.set_result(UtilityResult(self.address, False, reason))
        self._pending.clear()
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
    busy_loop = EngineBusyLoop(core)
    busy_loop.start()
    return busy_loop, engine_info_from_core(core.info)


# ---- the frontend's dataclasses <-> the engine's ------------------------------------
def engine_info_from_core(info) -> EngineInfo:
    """An engine_core.engine_core.EngineInfo as the frontend's EngineInfo."""
    return EngineInfo(model_name=info.model_name, model_path=info.model_path, max_model_len=info.max_model_len,
                      vocab_size=info.vocab_size, eos_token_ids=tuple(info.eos_token_ids))


def _core_request(request: EngineRequest):
    from engine_core.types import EngineCoreRequest  # torch-free; kept out of the frontend's import graph

    return EngineCoreRequest(request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
                             sampling_params=request.sampling_params, arrival_time=request.arrival_time,
                             priority=request.priority, trace_headers=dict(request.trace_headers) or None,
                             pooling=request.pooling, lora_name=request.lora_name)


def _outputs_from_core(message) -> list[EngineOutput]:
    """One step's outputs (services.engine.messages.ConnectionOutputs); ids only listed as finished end as ABORT."""
    outputs = [
        EngineOutput(
            request_id=o.request_id, new_token_ids=list(o.new_token_ids),
            new_logprobs=list(o.new_logprobs or ()), new_prompt_logprobs=list(o.new_prompt_logprobs or ()),
            finish_reason=o.finish_reason,
            stop_token_id=o.stop_reason if isinstance(o.stop_reason, int) else None,
            num_cached_tokens=o.num_cached_tokens,
            events=[EngineEvent(EngineEventType(int(e.type)), e.timestamp) for e in o.events or ()],
            timestamp=message.timestamp,
            embedding=o.embedding,
        )
        for o in message.outputs
    ]
    seen = {o.request_id for o in outputs if o.finish_reason is not None}
    outputs.extend(EngineOutput(request_id, [], finish_reason=FinishReason.ABORT)
                   for request_id in message.finished_request_ids if request_id not in seen)
    return outputs
