"""Calls on a whole engine (pause, sleep, profile, ...) and their answers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine_core.protocol.engine_state import PauseMode
from engine_core.protocol.lora_info import LoraInfo
from engine_core.protocol.scheduler_stats import SchedulerStats


class UtilityMethod(enum.IntEnum):
    """Numbered like tandem.v1.UtilityMethod."""

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
class UtilityCall:
    call_id: int  # the answer carries it back
    method: UtilityMethod
    pause_mode: PauseMode = PauseMode.ABORT  # PAUSE only
    profile_dir: str = ""  # START_PROFILE only ("" = the engine's default)
    lora_name: str = ""  # the LoRA methods
    lora_path: str = ""  # LOAD_LORA only


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
    stats: SchedulerStats | None = None  # GET_STATS only
    loras: tuple[LoraInfo, ...] = ()  # the LoRA methods' adapters
    error_kind: UtilityErrorKind | None = None
