"""How a control call reaches its handler: one table, from each call (engine_core/protocol/utility.py) to the
handler below that runs it on the busy loop's thread, between steps (vLLM's utility calls, which
EngineCoreProc._handle_client_request dispatches by name).

Adding a call touches four places: its message and its arm of UtilityCall.call in engine_core.proto, its
dataclass of the same name and fields in engine_core/protocol/utility.py (and in ControlCall), a line in
`EngineControl.handlers` and its handler. The convert modules map it by name; tests/services/
test_engine_control.py fails until the four agree.

A handler takes the call and its caller, (connection, call id). It returns the LoRA adapters the call concerns
(a LoRA call), None (nothing more to say) or ANSWERED_LATER (a WAIT pause, answered once nothing is in flight);
a ValueError refuses the call, with its message for the caller. Every answer carries the scheduler's stats, and
before it goes out every connection hears of the engine state or the prefix cache the call changed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from engine_core.lora.errors import LoraAdapterError, LoraDisabledError, LoraInUseError, UnknownLoraError
from engine_core.protocol import EngineCoreRequest, EngineState, LoraInfo, PauseMode
from engine_core.protocol.utility import (  # the calls' own module: a new call needs no re-export to reach its handler
    GetStatsCall,
    ListLorasCall,
    LoadLoraCall,
    PauseCall,
    PinLoraCall,
    ResetPrefixCacheCall,
    ResumeCall,
    SleepCall,
    StartProfileCall,
    StopProfileCall,
    UnloadLoraCall,
    UtilityCall,
    UtilityErrorKind,
    UtilityResult,
    WakeUpCall,
)
from services.engine.pause import PauseState, Waiter
from services.engine.routing import ConnectionRouter

if TYPE_CHECKING:  # torch-free to import, as the busy loop
    from engine_core.engine_core import EngineCore

Caller = Waiter  # (connection, call id): where the answer goes
Handler = Callable[[Any, Caller], Any]
ANSWERED_LATER = object()  # a handler's answer comes later, from `finish_drain`

_ERROR_KINDS = {  # the refusals whose status the engine names; any other ValueError leaves it to the frontend
    LoraAdapterError: UtilityErrorKind.INVALID_ARGUMENT,
    UnknownLoraError: UtilityErrorKind.NOT_FOUND,
    LoraInUseError: UtilityErrorKind.FAILED_PRECONDITION,
    LoraDisabledError: UtilityErrorKind.FAILED_PRECONDITION,
}


class EngineControl:
    """Runs the control calls for the busy loop, and keeps the engine state every connection was last told.
    Pause and resume share the busy loop's PauseState and ConnectionRouter; `admit` is its intake (a held add
    after resume) and `abort` its abort of engine ids (a PAUSE ABORT)."""

    def __init__(self, engine: EngineCore, router: ConnectionRouter, pause_state: PauseState, *,
                 admit: Callable[[int, EngineCoreRequest], None], abort: Callable[[list[str]], None]) -> None:
        self.engine = engine
        self._router = router
        self._pause_state = pause_state
        self._admit, self._abort_in_engine = admit, abort
        self.published_state = EngineState()  # what every connection was last told (the default: none)
        self.handlers: dict[type, Handler] = {  # the table: each control call and what runs it
            PauseCall: self.pause,
            ResumeCall: self.resume,
            ResetPrefixCacheCall: self.reset_prefix_cache,
            SleepCall: self.sleep,
            WakeUpCall: self.wake_up,
            StartProfileCall: self.start_profile,
            StopProfileCall: self.stop_profile,
            GetStatsCall: self.get_stats,
            LoadLoraCall: self.load_lora,
            UnloadLoraCall: self.unload_lora,
            ListLorasCall: self.list_loras,
            PinLoraCall: self.pin_lora,
        }

    def run(self, connection: int, utility: UtilityCall) -> None:
        """Run one call and answer it on its connection (now, or for a WAIT pause once nothing is in flight)."""
        handler = self.handlers.get(type(utility.call))
        try:
            if handler is None:  # only an in-process caller can send one: the convert modules know the table's calls
                raise ValueError(f"{type(utility.call).__name__} is not a control call")
            outcome = handler(utility.call, (connection, utility.call_id))
        except ValueError as exc:
            self._announce_changes()
            self._router.reply(connection, UtilityResult(utility.call_id, False, str(exc), self.engine.make_stats(),
                                                         error_kind=_ERROR_KINDS.get(type(exc))))
            return
        self._announce_changes()  # before the answer, so the caller's frontend already routes by them
        if outcome is not ANSWERED_LATER:
            self._router.reply(connection, UtilityResult(utility.call_id, True, stats=self.engine.make_stats(),
                                                         loras=outcome or ()))

    def finish_drain(self) -> None:
        """Nothing is in flight any more (finished or aborted): answer the WAIT pauses."""
        self._answer(self._pause_state.drained(), ok=True)

    def publish_state(self) -> None:
        """Tell every connection when pause, resume, sleep, wake-up or the LoRA adapters changed what happens
        to new requests."""
        paused = not self._pause_state.admitting
        state = EngineState(paused=paused, pause_mode=self._pause_state.mode if paused else None,
                            asleep=self.engine.asleep,
                            lora_names=tuple(info.name for info in self.engine.list_loras()))
        if state != self.published_state:
            self.published_state = state
            self._router.broadcast_state(state)

    # ---- the handlers, one per call ------------------------------------------------------
    def pause(self, call: PauseCall, caller: Caller):
        if call.pause_mode is PauseMode.ABORT:
            self._abort_everything()
        return None if self._pause_state.pause(call.pause_mode, caller) else ANSWERED_LATER

    def resume(self, call: ResumeCall, caller: Caller) -> None:
        cut_short, held = self._pause_state.resume()
        self._answer(cut_short, ok=False, error="resumed before the running requests finished")
        for connection, request in held:
            self._admit(connection, request)

    def reset_prefix_cache(self, call: ResetPrefixCacheCall, caller: Caller) -> None:
        if not self.engine.reset_prefix_cache():
            raise ValueError("KV blocks are in use by requests in flight; abort or finish them first")

    def sleep(self, call: SleepCall, caller: Caller) -> None:
        self.engine.sleep()

    def wake_up(self, call: WakeUpCall, caller: Caller) -> None:
        self.engine.wake_up()

    def start_profile(self, call: StartProfileCall, caller: Caller) -> None:
        self.engine.start_profile(call.profile_dir)

    def stop_profile(self, call: StopProfileCall, caller: Caller) -> None:
        self.engine.stop_profile()

    def get_stats(self, call: GetStatsCall, caller: Caller) -> None:
        """Nothing to run: every answer carries the stats."""

    # A load reads the adapter's folder here, on the loop's thread, so the running streams wait that long (one
    # step) and no more.
    def load_lora(self, call: LoadLoraCall, caller: Caller) -> tuple[LoraInfo, ...]:
        return (self.engine.add_lora(call.lora_name, call.lora_path),)

    def unload_lora(self, call: UnloadLoraCall, caller: Caller) -> tuple[LoraInfo, ...]:
        self.engine.remove_lora(call.lora_name)
        return ()

    def list_loras(self, call: ListLorasCall, caller: Caller) -> tuple[LoraInfo, ...]:
        return tuple(self.engine.list_loras())

    def pin_lora(self, call: PinLoraCall, caller: Caller) -> tuple[LoraInfo, ...]:
        return (self.engine.pin_lora(call.lora_name),)

    # ---- what the handlers share ------------------------------------------------------------
    def _announce_changes(self) -> None:
        """A prefix-cache reset clears every router's view now; a new engine state reaches every connection."""
        if (events := self.engine.take_kv_events()) is not None:
            self._router.broadcast_kv_events(events, self.engine.make_stats())
        self.publish_state()

    def _abort_everything(self) -> None:
        """Server-side aborts (PAUSE ABORT): each request gets an ABORT finish on its connection."""
        aborted: dict[int, list[str]] = {}
        for connection, in_flight in self._router.release_all().items():
            self._abort_in_engine(list(in_flight.values()))
            aborted[connection] = list(in_flight)
        for connection, request in self._pause_state.take_held():
            aborted.setdefault(connection, []).append(request.request_id)
        for connection, request_ids in aborted.items():
            self._router.send_aborted(connection, request_ids, self.engine.make_stats())

    def _answer(self, waiters: list[Waiter], ok: bool, error: str = "") -> None:
        for connection, call_id in waiters:
            self._router.reply(connection, UtilityResult(call_id, ok, error, self.engine.make_stats()))
