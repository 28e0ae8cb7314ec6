"""The busy loop's bookkeeping parts on their own (no engine, no gRPC): connection routing and pause state."""

from __future__ import annotations

import pytest

from engine_core.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    KVCacheEvents,
    PauseMode,
    SamplingParams,
    SchedulerStats,
)
from services.engine.pause import PauseState
from services.engine.routing import ConnectionRouter


def open_router(*connections: int) -> tuple[ConnectionRouter, dict[int, list]]:
    router, received = ConnectionRouter(), {}
    for connection in connections:
        received[connection] = []
        router.open(connection, received[connection].append)
    return router, received


def step(outputs=(), finished=()) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=list(outputs), finished_request_ids=set(finished), timestamp=1.0)


def test_two_connections_may_use_the_same_request_id():
    router, received = open_router(1, 2)
    a, b = router.assign(1, "x"), router.assign(2, "x")
    assert a != b
    router.route(step([EngineCoreOutput(a, [7]), EngineCoreOutput(b, [8], finish_reason=FinishReason.LENGTH)], [b]))
    [to_1], [to_2] = received[1], received[2]
    assert [(o.request_id, o.new_token_ids) for o in to_1.outputs] == [("x", [7])] and not to_1.finished_request_ids
    assert [(o.request_id, o.new_token_ids) for o in to_2.outputs] == [("x", [8])]
    assert to_2.finished_request_ids == {"x"}
    assert router.assign(2, "x") != b  # finished: the id may be used again
    with pytest.raises(ValueError, match="request id 'x' is already in flight"):
        router.assign(1, "x")


def test_prefix_cache_changes_reach_every_connection_in_one_message_per_step():
    router, received = open_router(1, 2)
    a = router.assign(1, "x")
    events, stats = KVCacheEvents(stored=[5, 6], removed=[4]), SchedulerStats(num_running_reqs=1)
    router.route(EngineCoreOutputs(outputs=[EngineCoreOutput(a, [7])], scheduler_stats=stats, timestamp=1.0,
                                   kv_events=events))
    [to_1], [to_2] = received[1], received[2]
    assert to_1.kv_events is events and [o.new_token_ids for o in to_1.outputs] == [[7]]
    assert to_2.kv_events is events and not to_2.outputs and to_2.scheduler_stats is stats  # idle, but told
    router.route(step([EngineCoreOutput(a, [8])]))
    assert len(received[2]) == 1, "no news, no message"
    router.send_snapshot(2, KVCacheEvents(stored=[5, 6], cleared=True),
                         SchedulerStats(num_running_reqs=1, prefix_cache_queries=40, num_generation_tokens=3))
    snapshot = received[2][-1]
    assert snapshot.kv_events.cleared and snapshot.scheduler_stats.num_running_reqs == 1
    assert snapshot.scheduler_stats.prefix_cache_queries == 0 and snapshot.scheduler_stats.num_generation_tokens == 0


def test_a_client_abort_is_reported_finished_once_and_frees_the_id_at_once():
    router, received = open_router(1)
    first = router.assign(1, "r")
    assert router.release(1, ["r", "r", "unknown"]) == [first]
    second = router.assign(1, "r")  # re-used before the engine reported the abort
    router.route(step(finished=[first]))
    assert received[1][-1].finished_request_ids == {"r"}
    assert router.release(1, ["r"]) == [second]  # the new request is still tracked


def test_close_and_release_all_forget_requests():
    router, received = open_router(1, 2)
    a, b, c = router.assign(1, "a"), router.assign(1, "b"), router.assign(2, "c")
    assert sorted(router.close(1)) == sorted([a, b]) and not router.is_open(1)
    assert router.release_all() == {2: {"c": c}}
    router.route(step([EngineCoreOutput(a, [1])], [a, b, c]))
    assert received == {1: [], 2: []}  # nobody left to tell: closed, or PAUSE ABORT already did
    router.send_aborted(2, ["c"], stats=None)
    [message] = received[2]
    assert isinstance(message, EngineCoreOutputs) and message.finished_request_ids == {"c"}
    assert message.outputs[0].finish_reason == FinishReason.ABORT


def test_a_refused_request_can_be_forgotten():
    router, received = open_router(1)
    router.forget(router.assign(1, "bad"))
    router.refuse(1, "bad", "the prompt is empty")
    assert received[1][0].errors[0].message == "the prompt is empty"
    router.assign(1, "bad")


def held(request_id: str) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1], SamplingParams())


def test_pause_modes_and_resume():
    state = PauseState()
    assert state.pause(PauseMode.KEEP, (1, 10)) and not state.admitting and not state.stepping
    state.hold(1, held("a"))
    state.hold(2, held("b"))
    state.hold(1, held("c"))
    state.drop_held(1, ["a"])
    assert state.resume() == ([], [(2, held("b")), (1, held("c"))])
    assert state.admitting and state.stepping and not state.held

    assert not state.pause(PauseMode.WAIT, (1, 11))  # completes later
    assert state.draining and state.stepping and not state.admitting
    assert state.drained() == [(1, 11)] and not state.stepping and not state.draining
    state.pause(PauseMode.WAIT, (2, 12))
    state.hold(2, held("d"))
    assert state.resume() == ([(2, 12)], [(2, held("d"))])  # a WAIT cut short is answered, not ok


def test_pause_abort_takes_every_held_add():
    state = PauseState()
    state.pause(PauseMode.ABORT, (1, 1))
    state.hold(1, held("a"))
    state.hold(2, held("b"))
    state.drop_held(2)
    assert state.take_held() == [(1, held("a"))] and not state.held


def test_both_busy_loops_implement_the_port():
    """The gRPC service and the in-process client drive either through BusyLoop's methods alone."""
    import inspect
    import socket

    from services.engine.busy_loop import EngineBusyLoop
    from services.engine.processes.busy_loop_interface import BusyLoop
    from services.engine.processes.socket_pair import RemoteBusyLoop

    port_methods = {name for name, _ in inspect.getmembers(BusyLoop) if not name.startswith("_")}
    for cls in (EngineBusyLoop, RemoteBusyLoop):
        assert port_methods <= set(dir(cls)), (cls, port_methods - set(dir(cls)))
    left, right = socket.socketpair()
    try:
        assert isinstance(RemoteBusyLoop(left), BusyLoop)
        assert isinstance(EngineBusyLoop(engine=None), BusyLoop)
    finally:
        left.close()
        right.close()
