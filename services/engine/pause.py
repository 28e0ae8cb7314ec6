"""Pause / Resume state of the busy loop: whether it admits new requests and whether it steps.

ABORT  the loop aborts what is in flight; then nothing is admitted or stepped.
KEEP   everything freezes in place; resume continues where it stopped.
WAIT   nothing new is admitted; running requests step until none is left (a drain: the server's
       graceful stop is one), then the pause completes and its caller is answered.
Adds that arrive while nothing is admitted are held, in order, and admitted again on resume.
Owned by the busy-loop thread; no locking.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine_core.protocol import EngineCoreRequest, PauseMode

Waiter = tuple[int, int]  # (connection, utility call id) of a WAIT pause, answered when the drain ends
HeldAdd = tuple[int, EngineCoreRequest]  # (connection, request)


@dataclass
class PauseState:
    admitting: bool = True
    stepping: bool = True
    mode: PauseMode | None = None  # the latest pause's, until resume
    held: deque[HeldAdd] = field(default_factory=deque)
    waiters: list[Waiter] = field(default_factory=list)

    def pause(self, mode: PauseMode, waiter: Waiter) -> bool:
        """Stop admitting; True when the pause is complete now (ABORT, KEEP), False for WAIT,
        which completes in `drained()` once nothing is in flight."""
        self.admitting = False
        self.mode = mode
        if mode is PauseMode.WAIT:
            self.stepping = True
            self.waiters.append(waiter)
            return False
        self.stepping = False
        return True

    @property
    def draining(self) -> bool:
        return bool(self.waiters)

    def drained(self) -> list[Waiter]:
        """Nothing is in flight any more: stop stepping; the WAIT pauses to answer (ok)."""
        self.stepping = False
        waiters, self.waiters = self.waiters, []
        return waiters

    def resume(self) -> tuple[list[Waiter], list[HeldAdd]]:
        """Admit and step again: the WAIT pauses cut short (to answer, not ok) and the held adds, in order."""
        self.admitting = self.stepping = True
        self.mode = None
        waiters, self.waiters = self.waiters, []
        held, self.held = list(self.held), deque()
        return waiters, held

    def hold(self, connection: int, request: EngineCoreRequest) -> None:
        self.held.append((connection, request))

    def drop_held(self, connection: int, request_ids: list[str] | None = None) -> None:
        """Forget a connection's held adds: those with `request_ids`, or all of them."""
        self.held = deque((c, r) for c, r in self.held
                          if c != connection or (request_ids is not None and r.request_id not in request_ids))

    def take_held(self) -> list[HeldAdd]:
        held, self.held = list(self.held), deque()
        return held
