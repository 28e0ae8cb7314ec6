"""The engine-core gRPC server, end to end over loopback with a tiny random Llama (fp32, CPU).

The reference is the offline LLMEngine on the same checkpoint and config.
"""

from __future__ import annotations

import pytest
from tandem.v1 import common_pb2, engine_core_pb2

from engine_core.protocol import EngineCoreOutputs, KVCacheEvents
from services.engine import convert
from services.engine.__main__ import main as engine_main
from services.frontend import convert as frontend_convert
from tests.services.conftest import MAX_MODEL_LEN
from tests.services.engine_server_harness import (
    LONG,
    assert_all_blocks_free,
    prompts,
)


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
    stream.add("fan", [5], n=2)  # the engine core samples one sequence per request: the frontend fans out
    stream.wait(lambda: len(stream.errors) == 6)
    assert "999 is out of range" in stream.errors["vocab"]
    assert "max_model_len" in stream.errors["long"]
    assert "top_p" in stream.errors["top_p"]
    assert "request_id" in stream.errors[""]
    assert stream.errors["dup"] == "request id 'dup' is already in flight"
    assert "n must be 1" in stream.errors["fan"]
    stream.abort("dup")
    assert not stream.call(engine_core_pb2.UtilityCall()).ok  # no call in it
    stream.add("good", [5, 6, 7], temperature=0.0, max_tokens=5)
    assert stream.wait_finished("good")["good"] == offline([[5, 6, 7]], max_tokens=5)[0]


def test_sampling_params_take_dataclass_defaults_for_unset_fields():
    def params_of(proto: common_pb2.SamplingParams):
        return convert.request_from_proto(engine_core_pb2.EngineCoreRequest(
            request_id="r", prompt_token_ids=[1], sampling_params=proto)).sampling_params

    params = params_of(common_pb2.SamplingParams(top_k=5, seed=7))
    assert (params.top_k, params.seed, params.max_tokens) == (5, 7, None)
    assert (params.temperature, params.top_p, params.repetition_penalty) == (1.0, 1.0, 1.0)
    assert params_of(common_pb2.SamplingParams(temperature=0.0)).is_greedy


def test_kv_events_keep_each_adapters_blocks_across_the_wire():
    events = KVCacheEvents(stored=[1, 2, 3, 2**64 - 1], removed=[9], cleared=True,
                           stored_lora={"x": [2, 2**64 - 1], "y": [3]})
    proto = convert.outputs_to_proto(EngineCoreOutputs(kv_events=events))
    assert [(g.lora_name, list(g.block_hashes)) for g in proto.kv_events.stored_lora_blocks] == [
        ("x", [2, 2**64 - 1]), ("y", [3])]
    wire = engine_core_pb2.EngineCoreOutputs.FromString(proto.SerializeToString())
    assert frontend_convert.message_from_proto(wire).kv_events == events
    base_only = convert.outputs_to_proto(EngineCoreOutputs(kv_events=KVCacheEvents(stored=[1])))
    assert not base_only.kv_events.stored_lora_blocks
    assert frontend_convert.message_from_proto(base_only).kv_events == KVCacheEvents(stored=[1])


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
