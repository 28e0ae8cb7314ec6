"""Calls on a whole engine (pause, sleep, profile, ...) and their answers."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine_core.protocol.engine_state import PauseMode
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

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class UtilityCall:
    call_id: int  # the answer carries it back
    method: UtilityMethod
    pause_mode: PauseMode = PauseMode.ABORT  # PAUSE only
    profile_dir: str = ""  # START_PROFILE only ("" = the engine's default)


@dataclass(frozen=True)
class UtilityResult:
    call_id: int
    ok: bool
    error: str = ""
    stats: SchedulerStats | None = None  # GET_STATS only
