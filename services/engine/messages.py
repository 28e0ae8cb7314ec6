"""Plain messages between the gRPC side and the engine's busy loop.

Inputs go onto the busy loop's queue as (connection id, item); outputs come back
to one connection's sink. `convert.py` turns protos into these and back, so the
busy loop never sees a generated class.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

from engine_core.lora.info import LoraInfo
from engine_core.types import EngineCoreOutput, EngineCoreRequest, KVCacheEvents, SchedulerStats


class UtilityMethod(enum.Enum):
    PAUSE = "pause"
    RESUME = "resume"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    SLEEP = "sleep"
    WAKE_UP = "wake_up"
    START_PROFILE = "start_profile"
    STOP_PROFILE = "stop_profile"
    GET_STATS = "get_stats"
    LOAD_LORA = "load_lora"
    UNLOAD_LORA = "unload_lora"
    LIST_LORAS = "list_loras"
    PIN_LORA = "pin_lora"


class PauseMode(enum.Enum):
    ABORT = "abort"  # abort everything in flight, then pause
    WAIT = "wait"  # stop admitting, let running requests finish, then pause
    KEEP = "keep"  # freeze in place; resume continues


class RequestErrorKind(enum.Enum):
    INVALID = "invalid"  # the request itself is bad: the client's to fix
    ASLEEP = "asleep"  # the engine sleeps until WakeUp: a state of the server, not the client's fault
    NOT_FOUND = "not_found"  # the request names a LoRA adapter the engine has not loaded


class UtilityErrorKind(enum.Enum):
    """Why a utility call was refused, when the engine says (the status the frontend answers with)."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    FAILED_PRECONDITION = "failed_precondition"


# ---- inputs: connection -> busy loop ------------------------------------------------
@dataclass(frozen=True)
class Open:
    """A new connection; `sink` is called from the loop thread with each output item."""

    sink: Callable[[object], None]


@dataclass(frozen=True)
class Close:
    """The connection went away: abort all of its requests."""


@dataclass(frozen=True)
class Add:
    request: EngineCoreRequest  # the request id as the connection knows it


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Utility:
    call_id: int
    method: UtilityMethod
    pause_mode: PauseMode = PauseMode.ABORT
    profile_dir: str = ""
    lora_name: str = ""  # the LoRA methods
    lora_path: str = ""  # LOAD_LORA


@dataclass(frozen=True)
class Call:
    """Run `fn()` on the loop thread (in-process tooling and tests)."""

    fn: Callable[[], None]


# ---- outputs: busy loop -> connection -----------------------------------------------
@dataclass(frozen=True)
class UtilityResult:
    call_id: int
    ok: bool
    error: str = ""
    stats: SchedulerStats | None = None
    loras: tuple[LoraInfo, ...] = ()  # the LoRA methods' adapters
    error_kind: UtilityErrorKind | None = None


@dataclass(frozen=True)
class RequestError:
    request_id: str
    message: str
    kind: RequestErrorKind = RequestErrorKind.INVALID


@dataclass(frozen=True)
class EngineState:
    """What the engine does with new requests; every connection is told when it changes."""

    paused: bool = False  # new requests are held until resume
    pause_mode: PauseMode | None = None  # while paused
    asleep: bool = False  # new requests are refused until wake-up
    lora_names: tuple[str, ...] = ()  # the LoRA adapters loaded (routers send their requests here)


@dataclass
class ConnectionOutputs:
    """One message for one connection: a step's outputs, a utility result or refusals."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_result: UtilityResult | None = None
    errors: list[RequestError] = field(default_factory=list)
    kv_events: KVCacheEvents | None = None  # the prefix cache's changes, sent to every connection
    engine_state: EngineState | None = None  # set when it changed, sent to every connection


@dataclass(frozen=True)
class EngineDied:
    """The busy loop crashed; the connection must end with an error."""

    error: str
