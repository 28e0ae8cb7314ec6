"""Control calls on a whole engine (pause, sleep, profile, ...) and their answers: tandem.v1.UtilityCall.

Each call is a class of its own, named and shaped like its message in engine_core.proto (`PauseCall` is the
`pause` arm of UtilityCall.call, with the same fields), so the convert modules map them by name alone. The
engine runs them between steps through one table, services/engine/control.py.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine_core.protocol.engine_state import PauseMode
from engine_core.protocol.scheduler_stats import SchedulerStats


class UtilityMethod(enum.IntEnum):
    """The older wire form's method (numbered like tandem.v1.UtilityMethod), still read by the engine for one
    release: each names its call's arm (PAUSE: `pause`, PauseCall)."""

    PAUSE = 1
    RESUME = 2
    RESET_PREFIX_CACHE = 3
    SLEEP = 4
    WAKE_UP = 5
    START_PROFILE = 6
    STOP_PROFILE = 7
    GET_STATS = 8
    LOAD_LORA = 9
    UNLOAD_LORA = 10
    LIST_LORAS = 11
    PIN_LORA = 12

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class PauseCall:
    pause_mode: PauseMode = PauseMode.ABORT


@dataclass(frozen=True)
class ResumeCall:
    pass


@dataclass(frozen=True)
class ResetPrefixCacheCall:
    pass


@dataclass(frozen=True)
class SleepCall:
    pass


@dataclass(frozen=True)
class WakeUpCall:
    pass


@dataclass(frozen=True)
class StartProfileCall:
    profile_dir: str


@dataclass(frozen=True)
class StopProfileCall:
    pass


@dataclass(frozen=True)
class GetStatsCall:
    pass


@dataclass(frozen=True)
class LoadLoraCall:
    lora_name: str
    lora_path: str

    def __post_init__(self) -> None:
        _require("load_lora", lora_name=self.lora_name, lora_path=self.lora_path)


@dataclass(frozen=True)
class UnloadLoraCall:
    lora_name: str

    def __post_init__(self) -> None:
        _require("unload_lora", lora_name=self.lora_name)


@dataclass(frozen=True)
class ListLorasCall:
    pass


@dataclass(frozen=True)
class PinLoraCall:
    lora_name: str

    def __post_init__(self) -> None:
        _require("pin_lora", lora_name=self.lora_name)


def _require(call: str, **fields: str) -> None:
    """ValueError naming the first empty field: the engine cannot run the call without it."""
    for name, value in fields.items():
        if not value:
            raise ValueError(f"utility {call}: {name} must not be empty")


# Every control call, in the order of UtilityCall.call
ControlCall = (PauseCall | ResumeCall | ResetPrefixCacheCall | SleepCall | WakeUpCall | StartProfileCall
               | StopProfileCall | GetStatsCall | LoadLoraCall | UnloadLoraCall | ListLorasCall | PinLoraCall)


@dataclass(frozen=True)
class UtilityCall:
    call_id: int  # the answer carries it back
    call: ControlCall


@dataclass(frozen=True)
class LoraInfo:
    """What an engine says of one loaded LoRA adapter, as `list_loras` (and the other LoRA calls) report it."""

    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    pinned: bool
    location: str  # "device" (in a slot), "host" (in host memory) or "disk" (read again when used)
    lora_id: int = 0  # 1, 2, ... in load order (vLLM's lora_int_id)


class UtilityErrorKind(enum.IntEnum):
    """Why a call was refused, when the engine says: the status the frontend answers with (numbered like
    tandem.v1.UtilityErrorKind; 0: not said)."""

    INVALID_ARGUMENT = 1
    NOT_FOUND = 2
    FAILED_PRECONDITION = 3


@dataclass(frozen=True)
class UtilityResult:
    call_id: int
    ok: bool
    error: str = ""
    stats: SchedulerStats | None = None  # the scheduler's, after the call (GetStatsCall's answer)
    loras: tuple[LoraInfo, ...] = ()  # the LoRA calls' adapters
    error_kind: UtilityErrorKind | None = None
