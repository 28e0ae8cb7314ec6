"""The engine's control calls (services/engine/control.py): one table from each call to its handler, every call
typed per method on the wire (UtilityCall.call), and the deprecated args-bag form still read for one release.

A new call is four edits (its proto message and arm, its protocol dataclass, a table line, its handler); the
first two tests fail until all four agree, so no call can be half-wired."""

from __future__ import annotations

import dataclasses
import logging
import typing

import pytest
from tandem.v1 import engine_core_pb2

from engine_core.lora.errors import LoraInUseError, UnknownLoraError
from engine_core.protocol import (
    ControlCall,
    EngineState,
    GetStatsCall,
    LoraInfo,
    PauseCall,
    PauseMode,
    ResetPrefixCacheCall,
    SchedulerStats,
    SleepCall,
    UnloadLoraCall,
    UtilityCall,
    UtilityErrorKind,
    UtilityMethod,
    UtilityResult,
)
from services.engine import convert as engine_convert
from services.engine.control import EngineControl
from services.engine.pause import PauseState
from services.engine.routing import ConnectionRouter
from services.frontend import convert as frontend_convert

ARMS = {field.name: field.message_type.name
        for field in engine_core_pb2.UtilityCall.DESCRIPTOR.oneofs_by_name["call"].fields}
CALLS = typing.get_args(ControlCall)
CALL_OF_ARM = {arm: cls for arm, name in ARMS.items() for cls in CALLS if cls.__name__ == name}
SAMPLE = {str: "x", PauseMode: PauseMode.KEEP}  # a value of each field type the calls have (not a default)


def sample(cls) -> ControlCall:
    return cls(**{name: SAMPLE[kind] for name, kind in typing.get_type_hints(cls).items()})


def control(engine=None) -> tuple[EngineControl, list]:
    router, replies = ConnectionRouter(), []
    router.open(1, replies.append)
    return EngineControl(engine, router, PauseState(), admit=lambda *_: None, abort=lambda _: None), replies


# ---- one table, every call ------------------------------------------------------------------
def test_the_table_has_a_handler_for_every_call_of_the_proto_and_nothing_else():
    assert sorted(ARMS.values()) == sorted(cls.__name__ for cls in CALLS), "UtilityCall.call vs ControlCall"
    assert set(control()[0].handlers) == set(CALLS), "ControlCall vs EngineControl.handlers"
    # the deprecated form's methods each name an arm (read by services/engine/convert.py)
    assert {str(method) for method in UtilityMethod} <= set(ARMS)
    assert {name.removeprefix("UTILITY_METHOD_").lower() for name, number in engine_core_pb2.UtilityMethod.items()
            if number} == {str(method) for method in UtilityMethod}


@pytest.mark.parametrize("cls", CALLS, ids=lambda cls: cls.__name__)
def test_each_call_has_the_fields_of_its_message(cls):
    message = getattr(engine_core_pb2, cls.__name__).DESCRIPTOR
    assert [f.name for f in dataclasses.fields(cls)] == [f.name for f in message.fields]
    for field in message.fields:  # an enum is the protocol's enum of the same name (tests/test_layering.py checks
        kind = typing.get_type_hints(cls)[field.name]  # their numbers), anything else a string
        if field.enum_type is not None:
            assert kind.__name__ == field.enum_type.name
        else:
            assert kind is str and field.type == field.TYPE_STRING


@pytest.mark.parametrize("cls", CALLS, ids=lambda cls: cls.__name__)
def test_every_call_crosses_the_wire_in_its_own_arm_unchanged(cls):
    call = sample(cls)
    proto = frontend_convert.utility_to_proto(UtilityCall(7, call)).utility
    assert ARMS[proto.WhichOneof("call")] == cls.__name__ and proto.method == 0
    assert engine_convert.utility_from_proto(proto) == UtilityCall(7, call)


# ---- the deprecated form ------------------------------------------------------------------------
@pytest.mark.parametrize("method", list(UtilityMethod), ids=str)
def test_the_deprecated_form_runs_the_same_call_and_says_it_is_deprecated(method, caplog):
    typed = sample(CALL_OF_ARM[str(method)])
    old = engine_core_pb2.UtilityCall(call_id=3, method=int(method),
                                      **{f.name: getattr(typed, f.name) for f in dataclasses.fields(typed)})
    engine_convert._warn_deprecated.cache_clear()
    with caplog.at_level(logging.WARNING, logger="services.engine.convert"):
        assert engine_convert.utility_from_proto(old) == UtilityCall(3, typed)
        engine_convert.utility_from_proto(old)
    [warning] = caplog.records  # once per method and process
    assert "deprecated" in warning.message and f"UtilityCall.{method}" in warning.message


def test_the_typed_arm_wins_over_the_deprecated_fields():
    both = engine_core_pb2.UtilityCall(call_id=1, method=engine_core_pb2.UTILITY_METHOD_SLEEP,
                                       pause=engine_core_pb2.PauseCall())
    assert engine_convert.utility_from_proto(both) == UtilityCall(1, PauseCall(PauseMode.ABORT))


@pytest.mark.parametrize("message, error", [
    (engine_core_pb2.UtilityCall(), "UtilityCall sets no arm of call (pause, resume,"),
    (engine_core_pb2.UtilityCall(method=99), "its deprecated method 99 is none"),
    (engine_core_pb2.UtilityCall(pause=engine_core_pb2.PauseCall(pause_mode=9)), "unknown pause_mode 9"),
    (engine_core_pb2.UtilityCall(load_lora=engine_core_pb2.LoadLoraCall(lora_name="a")),
     "load_lora: lora_path must not be empty"),
    (engine_core_pb2.UtilityCall(method=engine_core_pb2.UTILITY_METHOD_PIN_LORA), "pin_lora: lora_name must not be"),
])
def test_a_call_that_cannot_run_is_refused_naming_what_is_missing(message, error):
    with pytest.raises(ValueError, match=error.replace("(", r"\(")):
        engine_convert.utility_from_proto(message)


# ---- the table at work, on a stand-in engine -----------------------------------------------------
class StandInEngine:
    """The EngineCore calls the handlers make, recorded."""

    asleep = False

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.refuse: ValueError | None = None

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_total_blocks=8)

    def take_kv_events(self):
        return None

    def list_loras(self) -> list[LoraInfo]:
        return []

    def sleep(self) -> None:
        self.ran.append("sleep")
        self.asleep = True

    def reset_prefix_cache(self) -> bool:
        return False  # blocks in use

    def remove_lora(self, name: str) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.ran.append(f"remove_lora {name}")


def test_a_call_reaches_its_handler_and_its_answer_follows_the_new_state():
    engine = StandInEngine()
    table, replies = control(engine)
    table.run(1, UtilityCall(5, SleepCall()))
    assert engine.ran == ["sleep"]
    state, answer = replies
    assert state.engine_state == EngineState(asleep=True)  # told before the answer
    assert answer.utility_result == UtilityResult(5, True, stats=SchedulerStats(num_total_blocks=8))
    table.run(1, UtilityCall(6, GetStatsCall()))
    assert replies[-1].utility_result.ok and engine.ran == ["sleep"]


@pytest.mark.parametrize("refusal, kind", [
    (LoraInUseError("in use"), UtilityErrorKind.FAILED_PRECONDITION),
    (UnknownLoraError("no such adapter"), UtilityErrorKind.NOT_FOUND),
    (ValueError("plain"), None),
])
def test_a_refusal_answers_not_ok_with_the_status_it_names(refusal, kind):
    engine = StandInEngine()
    engine.refuse = refusal
    table, replies = control(engine)
    table.run(1, UtilityCall(2, UnloadLoraCall("a")))
    assert replies[-1].utility_result == UtilityResult(2, False, str(refusal), SchedulerStats(num_total_blocks=8),
                                                        error_kind=kind)


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use_and_an_unknown_call_never_crashes_the_loop():
    table, replies = control(StandInEngine())
    table.run(1, UtilityCall(3, ResetPrefixCacheCall()))
    assert not replies[-1].utility_result.ok and "in use" in replies[-1].utility_result.error
    table.run(1, UtilityCall(4, "sleep"))  # not a control call: refused, not raised
    assert replies[-1].utility_result.error == "str is not a control call"
