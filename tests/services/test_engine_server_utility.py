"""Engine server utility calls over the Connect stream: pause/resume, reset prefix cache, sleep and
wake up, profiling, stats and engine info."""

from __future__ import annotations

import grpc
from tandem.v1 import common_pb2, engine_core_pb2, engine_core_pb2_grpc

from engine_core.protocol import PauseCall, ResetPrefixCacheCall, SleepCall
from tests.held_steps import abort, steps_held_until, utility_call
from tests.services.conftest import MAX_MODEL_LEN
from tests.services.engine_server_harness import (
    LONG,
    assert_all_blocks_free,
)


def after_a_loop(stream) -> None:
    """Return once the busy loop has gone round at least once after everything sent so far: two stats calls
    in turn, and a loop that steps runs its step between them (it handles inputs only between steps)."""
    stream.stats()
    stream.stats()


# ---- utility calls --------------------------------------------------------------------
def test_pause_abort_aborts_everything_and_holds_new_adds_until_resume(engine_server, connect):
    stream, other = connect(engine_server.target), connect(engine_server.target)
    with steps_held_until(engine_server.server.busy_loop, utility_call(PauseCall)):
        stream.add("a", [7, 8, 9], **LONG)
        other.add("b", [7, 8], **LONG)
        other.wait(lambda: other.tokens.get("b"))
        result = stream.call("pause", pause_mode=common_pb2.PAUSE_MODE_ABORT)
    assert result.ok and result.stats.num_free_blocks == result.stats.num_total_blocks
    other.wait(lambda: other.finish.get("b") == common_pb2.FINISH_REASON_ABORT)
    assert stream.finish["a"] == common_pb2.FINISH_REASON_ABORT
    stream.add("held", [7, 8, 9], temperature=0.0, max_tokens=4)
    after_a_loop(stream)
    assert "held" not in stream.tokens and stream.stats().num_waiting_reqs == 0
    assert stream.call("resume").ok
    assert len(stream.wait_finished("held")["held"]) == 4


def test_pause_wait_lets_running_requests_finish(engine_server, connect):
    stream = connect(engine_server.target)
    stream.add("running", [7, 8, 9], **LONG)
    call_id = stream.utility("pause", pause_mode=common_pb2.PAUSE_MODE_WAIT)
    stream.add("queued", [7, 8], temperature=0.0, max_tokens=4)
    result = stream.wait(lambda: stream.results.get(call_id))
    assert result.ok
    assert stream.finish["running"] == common_pb2.FINISH_REASON_LENGTH
    assert "queued" not in stream.tokens
    assert_all_blocks_free(stream)
    assert stream.call("resume").ok
    assert len(stream.wait_finished("queued")["queued"]) == 4

    with steps_held_until(engine_server.server.busy_loop, abort):
        stream.add("aborted", [7, 8, 9], **LONG)  # a drain also ends when the last request is aborted
        call_id = stream.utility("pause", pause_mode=common_pb2.PAUSE_MODE_WAIT)
        stream.abort("aborted")
    assert stream.wait(lambda: stream.results.get(call_id)).ok
    assert "aborted" not in stream.finish
    assert stream.call("resume").ok


def test_pause_keep_freezes_and_resume_continues(engine_server, connect, offline):
    stream = connect(engine_server.target)
    with steps_held_until(engine_server.server.busy_loop, utility_call(PauseCall)):
        stream.add("kept", [7, 8, 9], **LONG)
        stream.wait(lambda: stream.tokens.get("kept"))
        assert stream.call("pause", pause_mode=common_pb2.PAUSE_MODE_KEEP).ok
    frozen = len(stream.tokens["kept"])
    after_a_loop(stream)
    assert len(stream.tokens["kept"]) == frozen < MAX_MODEL_LEN - 3
    assert stream.stats().num_running_reqs == 1
    assert stream.call("resume").ok
    assert stream.wait_finished("kept")["kept"] == offline([[7, 8, 9]], ignore_eos=True)[0]


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use(engine_server, connect):
    stream = connect(engine_server.target)
    with steps_held_until(engine_server.server.busy_loop, utility_call(ResetPrefixCacheCall)):
        stream.add("busy", [7, 8, 9, 10, 11], **LONG)
        stream.wait(lambda: stream.tokens.get("busy"))
        result = stream.call("reset_prefix_cache")
    assert not result.ok and "in use" in result.error
    stream.wait_finished("busy")
    assert stream.call("reset_prefix_cache").ok


def test_sleep_and_wake_up_give_identical_greedy_output(engine_server, connect):
    stream = connect(engine_server.target)
    prompt = [9, 10, 11, 12, 13, 14, 15, 16, 17]
    stream.add("before", prompt, temperature=0.0, max_tokens=8)
    before = stream.wait_finished("before")["before"]

    with steps_held_until(engine_server.server.busy_loop, utility_call(SleepCall)):
        stream.add("running", prompt, **LONG)
        stream.wait(lambda: stream.tokens.get("running"))
        refused = stream.call("sleep")
    assert not refused.ok and "in flight" in refused.error
    stream.abort("running")

    assert stream.call("sleep").ok
    assert engine_server.server.engine.runner.kv_caches == []
    stream.add("asleep", prompt)
    stream.wait(lambda: "asleep" in stream.errors)
    assert "asleep until WakeUp" in stream.errors["asleep"]
    assert stream.error_kinds["asleep"] == engine_core_pb2.REQUEST_ERROR_KIND_ASLEEP  # not the request's fault
    assert stream.call("wake_up").ok
    stream.add("after", prompt, temperature=0.0, max_tokens=8)
    assert stream.wait_finished("after")["after"] == before
    assert_all_blocks_free(stream)


def test_every_stream_is_told_the_engine_state_and_a_new_stream_gets_it_first(engine_server, connect):
    stream, other = connect(engine_server.target), connect(engine_server.target)
    assert stream.call("get_stats").ok and other.call("get_stats").ok
    assert stream.states == other.states == []  # an engine that admits says nothing

    call_id = stream.utility("pause", pause_mode=common_pb2.PAUSE_MODE_KEEP)
    stream.wait(lambda: stream.results.get(call_id))
    paused = engine_core_pb2.EngineState(paused=True, pause_mode=common_pb2.PAUSE_MODE_KEEP)
    assert stream.states == [paused]
    told = next(i for i, m in enumerate(stream.messages) if m.HasField("engine_state"))
    answered = next(i for i, m in enumerate(stream.messages) if m.utility_result.call_id == call_id)
    assert told < answered  # the caller's frontend routes by the new state before Pause returns
    other.wait(lambda: other.states == [paused])

    assert stream.call("sleep").ok
    asleep = engine_core_pb2.EngineState(paused=True, pause_mode=common_pb2.PAUSE_MODE_KEEP, asleep=True)
    late = connect(engine_server.target)
    late.wait(lambda: late.states)
    assert late.states == [asleep] and late.messages[0].HasField("engine_state")

    assert stream.call("wake_up").ok and stream.call("resume").ok
    for each in (stream, other, late):
        each.wait(lambda each=each: each.states[-1:] == [engine_core_pb2.EngineState()])
    assert stream.states == [paused, asleep, paused, engine_core_pb2.EngineState()]


def test_profile_writes_a_chrome_trace(engine_server, connect, tmp_path):
    stream = connect(engine_server.target)
    assert not stream.call("stop_profile").ok
    assert stream.call("start_profile", profile_dir=str(tmp_path / "trace")).ok
    stream.add("profiled", [5, 6], temperature=0.0, max_tokens=3)
    stream.wait_finished("profiled")
    assert stream.call("stop_profile").ok
    [trace] = (tmp_path / "trace").glob("*.json")
    assert trace.stat().st_size > 0


def test_get_stats_and_engine_info(engine_server, connect, tiny_model_dir):
    stats = connect(engine_server.target).stats()
    assert stats.num_total_blocks == 511 and stats.kv_cache_usage == 0.0
    with grpc.insecure_channel(engine_server.target) as channel:
        info = engine_core_pb2_grpc.EngineCoreServiceStub(channel).GetEngineInfo(engine_core_pb2.GetEngineInfoRequest())
    assert (info.model_path, info.max_model_len, info.block_size, info.num_blocks) == (
        str(tiny_model_dir), MAX_MODEL_LEN, 4, 512)
    assert (info.vocab_size, list(info.eos_token_ids), info.bos_token_id) == (256, [2, 3], 1)
    assert (info.dtype, info.device, info.attention_backend, info.kv_cache_dtype) == ("float32", "cpu", "torch", "fp32")
    assert (info.max_num_seqs, info.max_num_batched_tokens) == (32, 64)


def test_a_frontend_of_the_previous_release_still_pauses_and_resumes(engine_server, connect):
    """The deprecated form (UtilityCall.method and its arguments beside it) runs for one more release."""
    stream = connect(engine_server.target)
    U = engine_core_pb2
    assert stream.call(U.UtilityCall(method=U.UTILITY_METHOD_PAUSE, pause_mode=common_pb2.PAUSE_MODE_KEEP)).ok
    assert stream.states == [U.EngineState(paused=True, pause_mode=common_pb2.PAUSE_MODE_KEEP)]
    assert stream.call(U.UtilityCall(method=U.UTILITY_METHOD_RESUME)).ok
    stream.wait(lambda: stream.states[-1:] == [U.EngineState()])
