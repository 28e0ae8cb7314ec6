"""What an engine does with new requests: admit them, hold them (paused) or refuse them (asleep)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PauseMode(enum.IntEnum):
    """How a pause treats requests in flight (numbered like tandem.v1.PauseMode)."""

    ABORT = 1  # abort everything in flight, then pause
    WAIT = 2  # stop admitting, let running requests finish, then pause
    KEEP = 3  # freeze in place; resume continues

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(frozen=True)
class EngineState:
    """Every connection is told when it changes; an engine that said nothing admits requests."""

    paused: bool = False  # new requests are held until resume
    pause_mode: PauseMode | None = None  # while paused
    asleep: bool = False  # new requests are refused until wake-up
    lora_names: tuple[str, ...] = ()  # the LoRA adapters loaded (routers send their requests here)

    @property
    def admitting(self) -> bool:
        return not self.paused and not self.asleep
