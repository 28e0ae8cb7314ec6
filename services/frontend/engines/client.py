"""The interface AsyncLLM drives engines through: add and abort requests, utility calls, one output queue.

`grpc_client.GrpcEngineClient` implements it over gRPC for one or many engines,
`in_process.InProcessEngineClient` over an engine busy loop of this process. What an engine client hands
back is the frontend's own (what crosses to the engine is engine_core/protocol/): an `OutputBatch` on the
output queue, an `EngineStatus` per engine, an `EngineCallResult` per engine a utility call reached.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from engine_core.protocol import (
    ControlCall,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineState,
    FinishReason,
    LoraInfo,
    RequestError,
    RequestErrorKind,
    UtilityErrorKind,
)
from services.frontend.change_listeners import ChangeListeners
from services.frontend.errors import EngineAsleep, InvalidRequest, NotFound


@dataclass(frozen=True)
class EngineStatus:
    """One engine address as the engine client sees it."""

    address: str
    connected: bool
    num_in_flight: int
    state: EngineState = EngineState()


@dataclass(frozen=True)
class EngineCallResult:
    """One engine's answer to a utility call (pause, sleep, ...) made on every engine."""

    address: str
    ok: bool
    error: str = ""
    loras: tuple[LoraInfo, ...] = ()  # the LoRA calls' adapters
    error_kind: UtilityErrorKind | None = None  # why it was refused, when the engine said


@dataclass
class OutputBatch:
    """What AsyncLLM's output handler gets from the engine client at a time: one engine step's outputs (an
    engine's EngineCoreOutputs, read), or requests that failed."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    timestamp: float = 0.0  # the step's time, engine clock
    failed: list[str] = field(default_factory=list)  # engine request ids ended by `error`
    error: Exception | None = None

    @classmethod
    def of_step(cls, step: EngineCoreOutputs) -> OutputBatch:
        """A step's outputs; ids listed only as finished (ended in the engine without an output) end as ABORT."""
        outputs = list(step.outputs)
        if step.finished_request_ids:
            seen = {o.request_id for o in outputs if o.finish_reason is not None}
            outputs += [EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT)
                        for request_id in step.finished_request_ids if request_id not in seen]
        return cls(outputs=outputs, timestamp=step.timestamp)


class EngineClient(ChangeListeners, ABC):
    """Adds and aborts engine requests, makes utility calls, and queues engine outputs for `get_output()`."""

    def __init__(self) -> None:
        self._outputs: asyncio.Queue[OutputBatch] = asyncio.Queue()
        ChangeListeners.__init__(self)  # notified when an engine connects, disconnects, pauses, resumes, sleeps, wakes
        self.report_listeners: list[Callable] = []  # see add_report_listener

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None:
        """Send a request to an engine (never blocks); raises EngineUnavailable when none is connected."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests (never blocks; unknown ids are ignored)."""

    @abstractmethod
    async def call_utility(self, call: ControlCall) -> list[EngineCallResult]:
        """Make the control call `call` (engine_core/protocol/utility.py) on every engine connected; one result
        each."""

    @abstractmethod
    async def wait_for_engine(self) -> EngineInfo:
        """Wait until an engine is connected; its model info."""

    @property
    @abstractmethod
    def is_connected(self) -> bool: ...

    @property
    @abstractmethod
    def admitting(self) -> bool:
        """An engine is connected that starts new requests now: neither paused nor asleep."""

    @property
    @abstractmethod
    def num_in_flight(self) -> int:
        """Engine requests sent and not yet finished, aborted or lost."""

    @property
    @abstractmethod
    def engine_info(self) -> EngineInfo | None: ...

    @abstractmethod
    def engines(self) -> list[EngineStatus]: ...

    def add_report_listener(self, listener: Callable) -> None:
        """Call `listener(engine address, block size, SchedulerStats | None, KVCacheEvents | None)` with every
        engine's load and prefix-cache changes as they arrive (a gateway's KV events)."""
        self.report_listeners.append(listener)

    async def get_output(self) -> OutputBatch:
        """The next engine step's outputs, or requests that failed (AsyncLLM's output handler is the reader)."""
        return await self._outputs.get()

    def _put_output(self, outputs: OutputBatch) -> None:
        self._outputs.put_nowait(outputs)

    # ---- what both transports do with an engine's message, and with its loss ------------
    def _deliver(self, address: str, message: EngineCoreOutputs, pending: dict[int, asyncio.Future],
                 untrack: Callable[[list[str]], object]) -> None:
        """An engine's message, once its transport has read it: the utility answer to its caller, refusals and
        the step's outputs to the output handler. `pending`: the engine's utility calls by id; `untrack` forgets
        request ids that ended there."""
        if message.utility_result is not None:
            result = message.utility_result
            future = pending.pop(result.call_id, None)
            if future is not None and not future.done():
                future.set_result(EngineCallResult(address, result.ok, result.error, result.loras, result.error_kind))
        for error in message.errors:
            untrack([error.request_id])
            self._put_output(OutputBatch(failed=[error.request_id], error=refusal_error(error)))
        step = OutputBatch.of_step(message)
        if step.outputs:
            untrack([o.request_id for o in step.outputs if o.finish_reason is not None])
            self._put_output(step)

    def _fail_lost(self, address: str, lost: list[str], pending: dict[int, asyncio.Future], error: Exception,
                   call_error: str) -> None:
        """An engine is gone: its requests in flight (`lost`) end with `error` (UNAVAILABLE), its pending utility
        calls fail with `call_error`."""
        if lost:
            self._put_output(OutputBatch(failed=lost, error=error))
        for future in pending.values():
            if not future.done():
                future.set_result(EngineCallResult(address, False, call_error))
        pending.clear()


def with_adapter(engines: list, lora_name: str | None) -> list:
    """The engines (anything with an EngineState `state`) that have the LoRA adapter loaded; NotFound when none
    has. A base-model request may go to any."""
    if lora_name is None:
        return engines
    having = [e for e in engines if lora_name in e.state.lora_names]
    if not having:
        raise NotFound(f"no engine has the LoRA adapter {lora_name!r} loaded: load it (AdminService/LoadLoraAdapter, "
                       "`tandem admin lora load`) or name a loaded one (ListLoraAdapters)")
    return having


def refusal_error(error: RequestError) -> Exception:
    """What the client hears of a request an engine refused: its own fault, or the engine's state."""
    if error.kind is RequestErrorKind.ASLEEP:
        return EngineAsleep()
    if error.kind is RequestErrorKind.NOT_FOUND:
        return NotFound(f"the engine refused the request: {error.message}")
    return InvalidRequest(f"the engine refused the request: {error.message}")
