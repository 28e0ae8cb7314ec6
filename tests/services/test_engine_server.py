"""The engine-core gRPC server, end to end over loopback with a tiny random Llama (fp32, CPU).

The reference is the offline LLMEngine on the same checkpoint and config.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from tandem.v1 import common_pb2, engine_core_pb2, engine_core_pb2_grpc

from engine_core.llm_engine import LLMEngine
from engine_core.sampling_params import SamplingParams
from services.engine import convert
from services.engine.__main__ import main as engine_main
from tests.services.conftest import MAX_MODEL_LEN

M = engine_core_pb2  # utility method names
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
LONG = dict(temperature=0.0, ignore_eos=True)  # runs to max_model_len: ~90 steps


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 256) for _ in range(rng.randint(1, 20))] for _ in range(n)]


@pytest.fixture(scope="module")
def offline(engine_config):
    """offline(prompts, max_tokens=None, ignore_eos=False) -> greedy token lists from LLMEngine."""
    engine = LLMEngine(engine_config)

    def run(batch, max_tokens=None, ignore_eos=False):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        return [output.outputs[0].token_ids for output in engine.generate(batch, params)]

    return run


def assert_all_blocks_free(stream) -> None:
    stats = stream.stats()
    assert stats.num_free_blocks == stats.num_total_blocks > 0
    assert stats.num_running_reqs == stats.num_waiting_reqs == 0


def health_status(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def wait_health(target: str, status: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while health_status(target) != status:
        assert time.monotonic() < deadline, f"health never became {status}"
        time.sleep(0.05)


# ---- generation -----------------------------------------------------------------------
def test_greedy_matches_offline_engine_for_concurrent_requests(engine_server, connect, offline):
    batch = prompts(16)
    stream = connect(engine_server.target)
    for i, prompt in enumerate(batch):
        stream.add(f"r{i}", prompt, temperature=0.0, max_tokens=12)
    got = stream.wait_finished(*(f"r{i}" for i in range(16)))
    assert [got[f"r{i}"] for i in range(16)] == offline(batch, max_tokens=12)
    assert all(m.HasField("scheduler_stats") and m.timestamp > 0 for m in stream.messages)
    assert max(len(m.outputs) for m in stream.messages) > 1, "requests should share steps"
    finished = {r for m in stream.messages for r in m.finished_request_ids}
    assert finished == {f"r{i}" for i in range(16)}
    assert_all_blocks_free(stream)


def test_max_tokens_unset_runs_to_max_model_len(engine_server, connect, offline):
    [prompt] = prompts(1, seed=1)
    stream = connect(engine_server.target)
    stream.add("long", prompt, **LONG)
    tokens = stream.wait_finished("long")["long"]
    assert len(tokens) == MAX_MODEL_LEN - len(prompt)
    assert stream.finish["long"] == common_pb2.FINISH_REASON_LENGTH
    assert tokens == offline([prompt], ignore_eos=True)[0]


def test_two_connections_get_only_their_own_outputs(engine_server, connect, offline):
    batch = prompts(4, seed=2)
    a, b = connect(engine_server.target), connect(engine_server.target)
    for stream, (p, q) in ((a, batch[:2]), (b, batch[2:])):
        stream.add("x", p, temperature=0.0, max_tokens=10)
        stream.add("y", q, temperature=0.0, max_tokens=10)
    expected = offline(batch, max_tokens=10)
    assert a.wait_finished("x", "y") == {"x": expected[0], "y": expected[1]}
    assert b.wait_finished("x", "y") == {"x": expected[2], "y": expected[3]}
    for stream in (a, b):
        assert {o.request_id for m in stream.messages for o in m.outputs} == {"x", "y"}


def test_abort_over_the_stream_frees_all_blocks(engine_server, connect):
    stream = connect(engine_server.target)
    for i, prompt in enumerate(prompts(4, seed=3)):
        stream.add(f"a{i}", prompt, **LONG)
    stream.wait(lambda: len(stream.tokens.get("a3", [])) >= 2)
    stream.abort("a0", "a1", "a2", "a3", "unknown")
    assert_all_blocks_free(stream)
    assert not stream.finish, "a client abort sends no finish output: the client already knows"


def test_closing_a_stream_aborts_its_requests_only(engine_server, connect, offline):
    p, q = prompts(2, seed=4)
    a, b = connect(engine_server.target), connect(engine_server.target)
    a.add("r", p, **LONG)
    b.add("r", q, **LONG)
    a.wait(lambda: len(a.tokens.get("r", [])) >= 2)
    a.cancel()
    assert b.wait_finished("r")["r"] == offline([q], ignore_eos=True)[0]
    assert "r" not in a.finish
    assert_all_blocks_free(b)

    c = connect(engine_server.target)  # a half-close also ends the connection
    c.add("r", p, **LONG)
    c.wait(lambda: c.tokens.get("r"))
    c.close()
    c.wait(lambda: c.ended)
    assert c.rpc_error is None
    assert_all_blocks_free(b)


def test_stop_token_ids_and_logprobs_cross_the_wire(engine_server, connect, offline):
    prompt = [11, 12, 13]
    expected = offline([prompt], max_tokens=6, ignore_eos=True)[0]
    stream = connect(engine_server.target)
    stream.add("s", prompt, temperature=0.0, ignore_eos=True, stop_token_ids=[expected[3]], logprobs=2)
    tokens = stream.wait_finished("s")["s"]
    assert tokens == expected[: expected.index(expected[3]) + 1]
    [last] = [o for m in stream.messages for o in m.outputs if o.finish_reason]
    assert (last.finish_reason, last.stop_token_id) == (common_pb2.FINISH_REASON_STOP, expected[3])
    logprobs = [lp for m in stream.messages for o in m.outputs for lp in o.new_logprobs]
    assert len(logprobs) == len(tokens)
    assert all(len(lp.token_ids) == 3 and lp.rank == 1 for lp in logprobs)  # chosen + top-2; greedy
    assert [lp.token_ids[0] for lp in logprobs] == tokens


def test_bad_requests_get_request_errors_and_the_stream_stays_usable(engine_server, connect, offline):
    stream = connect(engine_server.target)
    stream.add("vocab", [5, 999])
    stream.add("long", [5] * MAX_MODEL_LEN)
    stream.add("top_p", [5], top_p=0.0)
    stream.add("", [5])
    stream.add("dup", [5, 6], **LONG)
    stream.add("dup", [5, 6])
    stream.wait(lambda: len(stream.errors) == 5)
    assert "999 is out of range" in stream.errors["vocab"]
    assert "max_model_len" in stream.errors["long"]
    assert "top_p" in stream.errors["top_p"]
    assert "request_id" in stream.errors[""]
    assert stream.errors["dup"] == "request id 'dup' is already in flight"
    stream.abort("dup")
    assert not stream.call(M.UTILITY_METHOD_UNSPECIFIED).ok
    stream.add("good", [5, 6, 7], temperature=0.0, max_tokens=5)
    assert stream.wait_finished("good")["good"] == offline([[5, 6, 7]], max_tokens=5)[0]


def test_sampling_params_take_dataclass_defaults_for_unset_fields():
    params = convert.sampling_params_from_proto(common_pb2.SamplingParams(top_k=5, seed=7))
    assert (params.top_k, params.seed, params.max_tokens) == (5, 7, None)
    assert (params.temperature, params.top_p, params.repetition_penalty) == (1.0, 1.0, 1.0)
    assert convert.sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0)).is_greedy
    with pytest.raises(ValueError, match="n must be 1"):
        convert.sampling_params_from_proto(common_pb2.SamplingParams(n=2))


def test_cli_reports_bad_config_in_one_line(capsys, tiny_model_dir):
    for argv, message in (
        (["--model", "/no/such/model"], "not found"),
        (["--model", str(tiny_model_dir), "--block-size", "3"], "block_size must be a power of two"),
        (["--model", str(tiny_model_dir), "--max-model-len", "9999"], "longer than the model's context"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            engine_main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and message in err
        assert err.startswith("tandem-engine: error:") and err.count("\n") == 1


# ---- utility calls --------------------------------------------------------------------
def test_pause_abort_aborts_everything_and_holds_new_adds_until_resume(engine_server, connect):
    stream, other = connect(engine_server.target), connect(engine_server.target)
    stream.add("a", [7, 8, 9], **LONG)
    other.add("b", [7, 8], **LONG)
    other.wait(lambda: other.tokens.get("b"))
    result = stream.call(M.UTILITY_METHOD_PAUSE, pause_mode=common_pb2.PAUSE_MODE_ABORT)
    assert result.ok and result.stats.num_free_blocks == result.stats.num_total_blocks
    other.wait(lambda: other.finish.get("b") == common_pb2.FINISH_REASON_ABORT)
    assert stream.finish["a"] == common_pb2.FINISH_REASON_ABORT
    stream.add("held", [7, 8, 9], temperature=0.0, max_tokens=4)
    time.sleep(0.2)
    assert "held" not in stream.tokens
    assert stream.call(M.UTILITY_METHOD_RESUME).ok
    assert len(stream.wait_finished("held")["held"]) == 4


def test_pause_wait_lets_running_requests_finish(engine_server, connect):
    stream = connect(engine_server.target)
    stream.add("running", [7, 8, 9], **LONG)
    call_id = stream.utility(M.UTILITY_METHOD_PAUSE, pause_mode=common_pb2.PAUSE_MODE_WAIT)
    stream.add("queued", [7, 8], temperature=0.0, max_tokens=4)
    result = stream.wait(lambda: stream.results.get(call_id))
    assert result.ok
    assert stream.finish["running"] == common_pb2.FINISH_REASON_LENGTH
    assert "queued" not in stream.tokens
    assert_all_blocks_free(stream)
    assert stream.call(M.UTILITY_METHOD_RESUME).ok
    assert len(stream.wait_finished("queued")["queued"]) == 4

    stream.add("aborted", [7, 8, 9], **LONG)  # a drain also ends when the last request is aborted
    call_id = stream.utility(M.UTILITY_METHOD_PAUSE, pause_mode=common_pb2.PAUSE_MODE_WAIT)
    stream.abort("aborted")
    assert stream.wait(lambda: stream.results.get(call_id)).ok
    assert "aborted" not in stream.finish
    assert stream.call(M.UTILITY_METHOD_RESUME).ok


def test_pause_keep_freezes_and_resume_continues(engine_server, connect, offline):
    stream = connect(engine_server.target)
    stream.add("kept", [7, 8, 9], **LONG)
    stream.wait(lambda: stream.tokens.get("kept"))
    assert stream.call(M.UTILITY_METHOD_PAUSE, pause_mode=common_pb2.PAUSE_MODE_KEEP).ok
    frozen = len(stream.tokens["kept"])
    time.sleep(0.2)
    assert len(stream.tokens["kept"]) == frozen < MAX_MODEL_LEN - 3
    assert stream.stats().num_running_reqs == 1
    assert stream.call(M.UTILITY_METHOD_RESUME).ok
    assert stream.wait_finished("kept")["kept"] == offline([[7, 8, 9]], ignore_eos=True)[0]


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use(engine_server, connect):
    stream = connect(engine_server.target)
    stream.add("busy", [7, 8, 9, 10, 11], **LONG)
    stream.wait(lambda: stream.tokens.get("busy"))
    result = stream.call(M.UTILITY_METHOD_RESET_PREFIX_CACHE)
    assert not result.ok and "in use" in result.error
    stream.wait_finished("busy")
    assert stream.call(M.UTILITY_METHOD_RESET_PREFIX_CACHE).ok


def test_sleep_and_wake_up_give_identical_greedy_output(engine_server, connect):
    stream = connect(engine_server.target)
    prompt = [9, 10, 11, 12, 13, 14, 15, 16, 17]
    stream.add("before", prompt, temperature=0.0, max_tokens=8)
    before = stream.wait_finished("before")["before"]

    stream.add("running", prompt, **LONG)
    stream.wait(lambda: stream.tokens.get("running"))
    refused = stream.call(M.UTILITY_METHOD_SLEEP)
    assert not refused.ok and "in flight" in refused.error
    stream.abort("running")

    assert stream.call(M.UTILITY_METHOD_SLEEP).ok
    assert engine_server.server.engine.runner.kv_caches == []
    stream.add("asleep", prompt)
    stream.wait(lambda: "asleep" in stream.errors)
    assert "engine is asleep; call WakeUp" in stream.errors["asleep"]
    assert stream.call(M.UTILITY_METHOD_WAKE_UP).ok
    stream.add("after", prompt, temperature=0.0, max_tokens=8)
    assert stream.wait_finished("after")["after"] == before
    assert_all_blocks_free(stream)


def test_profile_writes_a_chrome_trace(engine_server, connect, tmp_path):
    stream = connect(engine_server.target)
    assert not stream.call(M.UTILITY_METHOD_STOP_PROFILE).ok
    assert stream.call(M.UTILITY_METHOD_START_PROFILE, profile_dir=str(tmp_path / "trace")).ok
    stream.add("profiled", [5, 6], temperature=0.0, max_tokens=3)
    stream.wait_finished("profiled")
    assert stream.call(M.UTILITY_METHOD_STOP_PROFILE).ok
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
    assert (info.dtype, info.device, info.attention_backend) == ("float32", "cpu", "torch")
    assert (info.max_num_seqs, info.max_num_batched_tokens) == (32, 64)


# ---- health, reflection, failures -------------------------------------------------------
def test_reflection_lists_the_services(engine_server):
    with grpc.insecure_channel(engine_server.target) as channel:
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"tandem.v1.EngineCoreService", "grpc.health.v1.Health"} <= set(services)


def test_health_goes_not_serving_while_the_loop_stalls(make_server):
    server = make_server(stall_timeout=0.3)
    assert health_status(server.target) == SERVING
    assert health_status(server.target, "tandem.v1.EngineCoreService") == SERVING
    unblock = threading.Event()
    try:
        server.server.busy_loop.run_in_loop(lambda: unblock.wait(20))
        wait_health(server.target, NOT_SERVING)
        assert health_status(server.target, "tandem.v1.EngineCoreService") == NOT_SERVING
    finally:
        unblock.set()
    wait_health(server.target, SERVING)


def test_health_goes_not_serving_on_stop(make_server):
    server = make_server()
    channel = grpc.insecure_channel(server.target)
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == SERVING
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 1.0})
        stopper.start()
        assert next(watch).status == NOT_SERVING
        stopper.join()
    finally:
        channel.close()


def test_a_crashed_loop_fails_streams_and_health(make_server, connect):
    server = make_server()
    stream = connect(server.target)
    stream.add("r", [5, 6], **LONG)
    stream.wait(lambda: stream.tokens.get("r"))

    def crash():
        raise RuntimeError("boom")

    server.server.busy_loop.run_in_loop(crash)
    stream.wait(lambda: stream.ended)
    assert stream.rpc_error.code() == grpc.StatusCode.UNAVAILABLE
    assert "boom" in stream.rpc_error.details()
    wait_health(server.target, NOT_SERVING)
    late = connect(server.target)
    late.wait(lambda: late.ended)
    assert late.rpc_error.code() == grpc.StatusCode.UNAVAILABLE
