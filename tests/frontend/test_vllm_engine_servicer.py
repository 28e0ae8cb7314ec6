"""vLLM's worker protocol (vllm.grpc.engine.VllmEngine) on the frontend, RPC by RPC and edge by edge: unary
calls without an engine under grpc_testing, the rest over real gRPC against the fake engine
(tests/frontend/fake_engine.py), with the message classes from smg-grpc-proto as a gateway sends them."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile

import grpc
import grpc_testing
import pytest
from smg_grpc_proto.generated import common_pb2, vllm_engine_pb2, vllm_engine_pb2_grpc
from tokenizers import Tokenizer

from services.frontend.async_llm import AsyncLLM
from services.frontend.gateway.servicer import VllmEngineServicer
from services.frontend.gateway.tokenizer_archive import CHUNK_BYTES
from services.frontend.server import VERSION, status_for
from tests.frontend.conftest import wait_until
from tests.frontend.test_units import _NoEngine, _SyncShell

SERVICE = vllm_engine_pb2.DESCRIPTOR.services_by_name["VllmEngine"]


# ---- no engine connected (grpc_testing) ----------------------------------------------
@pytest.fixture
def no_engine(tokenizer):
    servicer = _SyncShell(VllmEngineServicer(AsyncLLM(_NoEngine(), tokenizer), version=VERSION,
                                             status_for=status_for))
    return grpc_testing.server_from_dictionary({SERVICE: servicer}, grpc_testing.strict_real_time())


def unary(server, method: str, request):
    rpc = server.invoke_unary_unary(SERVICE.methods_by_name[method], (), request, None)
    response, _, code, details = rpc.termination()
    return response, code, details


def test_health_check_without_an_engine_is_unhealthy_and_says_why(no_engine):
    response, code, _ = unary(no_engine, "HealthCheck", vllm_engine_pb2.HealthCheckRequest())
    assert code == grpc.StatusCode.OK and not response.healthy and "no engine is connected" in response.message


def test_model_info_without_an_engine_is_unavailable(no_engine):
    _, code, details = unary(no_engine, "GetModelInfo", vllm_engine_pb2.GetModelInfoRequest())
    assert code == grpc.StatusCode.UNAVAILABLE and "no engine" in details


def test_loads_and_server_info_without_an_engine_are_zero(no_engine):
    loads, code, _ = unary(no_engine, "GetLoads", vllm_engine_pb2.GetLoadsRequest())
    assert code == grpc.StatusCode.OK and loads.dp_rank_count == 1 and loads.loads[0].num_running_reqs == 0
    _, code, details = unary(no_engine, "GetLoads", vllm_engine_pb2.GetLoadsRequest(dp_rank=3))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dp_rank 3" in details
    info, code, _ = unary(no_engine, "GetServerInfo", vllm_engine_pb2.GetServerInfoRequest())
    assert code == grpc.StatusCode.OK and info.active_requests == 0 and info.data_parallel_size == 1


def test_start_profile_refuses_what_tandem_cannot_do(no_engine):
    _, code, details = unary(no_engine, "StartProfile", common_pb2.StartProfileRequest(num_steps=5))
    assert code == grpc.StatusCode.UNIMPLEMENTED and "num_steps" in details


# ---- a fake engine behind the frontend (real gRPC) ------------------------------------------
@pytest.fixture(scope="module")
def vllm(stack):
    return vllm_engine_pb2_grpc.VllmEngineStub(stack.channel)


def generate(stack, vllm, request: vllm_engine_pb2.GenerateRequest) -> list[vllm_engine_pb2.GenerateResponse]:
    async def call():
        return [response async for response in vllm.Generate(request)]
    return stack.run(call())


def call_on_loop(stack, rpc, request):
    """One unary call, started on the stack's loop (a grpc.aio call needs a running loop to start on)."""
    async def call():
        return await rpc(request)
    return stack.run(call())


def tokenized(ids, **params) -> vllm_engine_pb2.GenerateRequest:
    stream = params.pop("stream", True)
    return vllm_engine_pb2.GenerateRequest(
        request_id=params.pop("request_id", ""), tokenized=vllm_engine_pb2.TokenizedInput(input_ids=ids),
        sampling_params=vllm_engine_pb2.SamplingParams(**params), stream=stream)


def status_of(stack, vllm, request) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as error:
        generate(stack, vllm, request)
    return error.value.code(), error.value.details()


def test_health_and_model_info_with_an_engine(stack, vllm, tokenizer):
    health = call_on_loop(stack, vllm.HealthCheck, vllm_engine_pb2.HealthCheckRequest())
    assert health.healthy and health.message == "serving"
    info = call_on_loop(stack, vllm.GetModelInfo, vllm_engine_pb2.GetModelInfoRequest())
    assert info.max_context_length == stack.engine.max_model_len and info.vocab_size == tokenizer.vocab_size
    assert info.is_generation and info.served_model_name and info.tokenizer_path and info.model_path
    assert list(info.eos_token_ids) == [tokenizer.tokenizer.token_to_id(tokenizer.eos_token)]
    assert info.max_req_input_len == info.max_context_length - 1


def test_get_tokenizer_streams_a_zip_of_what_the_frontend_loaded(stack, vllm, tokenizer):
    async def call():
        return [chunk async for chunk in vllm.GetTokenizer(common_pb2.GetTokenizerRequest())]
    chunks = stack.run(call())
    data = b"".join(c.data for c in chunks)
    assert len(chunks) == -(-len(data) // CHUNK_BYTES) > 1 and all(len(c.data) == CHUNK_BYTES for c in chunks[:-1])
    assert [c.sha256 for c in chunks[:-1]] == [""] * (len(chunks) - 1)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    files = zipfile.ZipFile(io.BytesIO(data))
    assert sorted(files.namelist()) == ["config.json", "generation_config.json", "tokenizer.json",
                                        "tokenizer_config.json"]
    rebuilt = Tokenizer.from_str(files.read("tokenizer.json").decode())
    text = "Hello <|im_start|>user 12345 héllo"
    assert rebuilt.encode(text, add_special_tokens=False).ids == tokenizer.encode(text, add_special_tokens=False)
    config = json.loads(files.read("tokenizer_config.json"))
    assert config["chat_template"] == stack.llm.chat_template  # what the frontend renders with (tools-aware)
    assert "tools" in config["chat_template"]  # SmolLM2's shipped tools template, not the GGUF's own
    assert config["eos_token"] == tokenizer.eos_token and config["bos_token"] == tokenizer.bos_token
    eos = tokenizer.tokenizer.token_to_id(tokenizer.eos_token)
    assert json.loads(files.read("generation_config.json"))["eos_token_id"] == [eos]
    assert json.loads(files.read("config.json"))["max_position_embeddings"] == stack.engine.max_model_len
    again = b"".join(c.data for c in stack.run(call()))
    assert again == data  # built once, the same bytes every time


def test_generate_streams_token_deltas_then_one_final_message(stack, vllm):
    prompt = [101, 102, 103]
    responses = generate(stack, vllm, tokenized(prompt, max_tokens=7, temperature=0))
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    [complete] = [r.complete for r in responses if r.HasField("complete")]
    assert responses[-1].HasField("complete")
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == (prompt * 3)[:7] and all(c.prompt_tokens == 3 for c in chunks)
    assert complete.finish_reason == "length" and complete.prompt_tokens == 3
    assert list(complete.output_ids) == list(chunks[-1].token_ids)  # the last delta, as vLLM's servicer


def test_generate_without_stream_answers_once_per_output_with_every_token(stack, vllm):
    responses = generate(stack, vllm, tokenized([7, 8], max_tokens=5, n=2, seed=3, stream=False))
    assert all(r.HasField("complete") for r in responses)
    assert sorted(r.complete.index for r in responses) == [0, 1]
    for r in responses:
        assert list(r.complete.output_ids) == [7, 8, 7, 8, 7] and r.complete.completion_tokens == 5


def test_n_2_streams_interleave_by_index(stack, vllm):
    responses = generate(stack, vllm, tokenized([5, 6, 7], max_tokens=4, n=2, seed=1))
    completes = [r.complete for r in responses if r.HasField("complete")]
    assert sorted(c.index for c in completes) == [0, 1] and {c.finish_reason for c in completes} == {"length"}
    for index in (0, 1):
        ids = [t for r in responses if r.HasField("chunk") and r.chunk.index == index for t in r.chunk.token_ids]
        assert ids == [5, 6, 7, 5]


def test_stop_strings_are_applied_by_the_worker(stack, vllm, tokenizer):
    """A gateway that sees the stop string in its own text neither aborts nor cancels: the worker stops."""
    words = tokenizer.encode(" alpha beta STOP gamma delta epsilon zeta", add_special_tokens=False)
    stack.scripts["stops"] = words * 10
    responses = generate(stack, vllm, tokenized([11, 12], request_id="stops", max_tokens=60, stop=["STOP"]))
    [complete] = [r.complete for r in responses if r.HasField("complete")]
    assert complete.finish_reason == "stop" and complete.matched_stop_str == "STOP"
    sent = [t for r in responses if r.HasField("chunk") for t in r.chunk.token_ids]
    assert len(sent) < 10 and "gamma" not in tokenizer.decode(sent)
    stack.run(wait_until(lambda: "stops" in stack.engine.aborted))  # the engine stops too


def test_stop_token_ids_and_logprobs(stack, vllm):
    stack.scripts["stop-token"] = [40, 41, 42, 43, 44]
    responses = generate(stack, vllm, tokenized([1, 2], request_id="stop-token", max_tokens=10,
                                               stop_token_ids=[42], logprobs=2, temperature=0))
    [complete] = [r.complete for r in responses if r.HasField("complete")]
    assert complete.finish_reason == "stop" and complete.matched_token_id == 42
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    ids = [t for c in chunks for t in c.token_ids]
    logprobs = [lp for c in chunks for lp in zip(c.output_logprobs.token_ids, c.output_logprobs.token_logprobs)]
    assert [t for t, _ in logprobs] == ids == [40, 41, 42]
    tops = [top for c in chunks for top in c.output_logprobs.top_logprobs]
    assert len(tops) == 3 and all(len(top.token_ids) == 2 for top in tops)


def test_text_input_is_tokenized_by_the_frontend(stack, vllm, tokenizer):
    request = vllm_engine_pb2.GenerateRequest(text="Hello there", stream=False,
                                              sampling_params=vllm_engine_pb2.SamplingParams(max_tokens=2))
    [response] = generate(stack, vllm, request)
    assert response.complete.prompt_tokens == len(tokenizer.encode("Hello there"))


def test_truncate_prompt_tokens_keeps_the_last_tokens(stack, vllm):
    [response] = generate(stack, vllm, tokenized([1, 2, 3, 4, 5], max_tokens=2, truncate_prompt_tokens=2,
                                                 stream=False))
    assert response.complete.prompt_tokens == 2 and list(response.complete.output_ids) == [4, 5]


@pytest.mark.parametrize(("request_fields", "params", "code", "words"), [
    ({"mm_inputs": vllm_engine_pb2.MultimodalInputs()}, {}, grpc.StatusCode.UNIMPLEMENTED, "multimodal"),
    ({"media_refs": vllm_engine_pb2.MediaRefs()}, {}, grpc.StatusCode.UNIMPLEMENTED, "multimodal"),
    ({"kv_transfer_params_json": "{}"}, {}, grpc.StatusCode.UNIMPLEMENTED, "disaggregation"),
    ({"kv_transfer_params": vllm_engine_pb2.KvTransferParams(remote_port=1)}, {}, grpc.StatusCode.UNIMPLEMENTED,
     "kv_transfer_params"),
    ({"data_parallel_rank": 2}, {}, grpc.StatusCode.INVALID_ARGUMENT, "data_parallel_rank 2"),
    ({}, {"structural_tag": "{}"}, grpc.StatusCode.UNIMPLEMENTED, "structural_tag"),
    ({}, {"logprobs": -1}, grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
    ({}, {"top_p": 1.5}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
    ({}, {"grammar": "root ::= ("}, grpc.StatusCode.INVALID_ARGUMENT, "grammar"),
    ({}, {"json_schema": "{not json"}, grpc.StatusCode.INVALID_ARGUMENT, "json_schema"),
    ({}, {"truncate_prompt_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT, "truncate_prompt_tokens"),
])
def test_what_tandem_cannot_do_or_bad_input_gets_a_clear_status(stack, vllm, request_fields, params, code, words):
    request = tokenized([1, 2, 3], max_tokens=2, **params)
    for name, value in request_fields.items():
        field = getattr(request, name, None)
        if hasattr(field, "CopyFrom"):
            field.CopyFrom(value)
        else:
            setattr(request, name, value)
    got, details = status_of(stack, vllm, request)
    assert got == code and words in details


def test_missing_input_and_out_of_vocabulary_ids_are_invalid(stack, vllm, tokenizer):
    code, details = status_of(stack, vllm, vllm_engine_pb2.GenerateRequest())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "input is missing" in details
    code, details = status_of(stack, vllm, tokenized([1, tokenizer.vocab_size + 5], max_tokens=2))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "out of range" in details


def test_gbnf_grammars_and_choices_are_accepted(stack, vllm, tokenizer):
    yes = tokenizer.encode("yes", add_special_tokens=False)
    stack.scripts["gbnf"] = yes
    responses = generate(stack, vllm, tokenized([3, 4], request_id="gbnf", max_tokens=5, stream=False,
                                               grammar='root ::= "yes" | "no"'))
    assert responses[-1].complete.finish_reason in ("stop", "length")
    assert stack.engine.added["gbnf"].sampling_params.structured.grammar.startswith("%llguidance")  # as Lark
    stack.scripts["choice"] = yes
    responses = generate(stack, vllm, tokenized([3, 4], request_id="choice", max_tokens=5, stream=False,
                                               choice=vllm_engine_pb2.ChoiceConstraint(choices=["yes", "no"])))
    assert list(stack.engine.added["choice"].sampling_params.structured.choice.options) == ["yes", "no"]


def test_abort_ends_a_running_stream_with_abort(make_stack):
    stack = make_stack(step_delay_s=0.02)
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(stack.channel)

    async def call():
        stream = vllm.Generate(tokenized([9, 9], request_id="to-abort", max_tokens=500))
        first = await stream.read()
        assert first.HasField("chunk")
        await vllm.Abort(vllm_engine_pb2.AbortRequest(request_ids=["to-abort", "unknown"]))
        rest = []
        while (response := await stream.read()) is not grpc.aio.EOF:
            rest.append(response)
        return rest
    rest = stack.run(call())
    assert rest[-1].complete.finish_reason == "abort"
    stack.run(wait_until(lambda: "to-abort" in stack.engine.aborted))


def test_flush_cache_resets_every_engines_prefix_cache(stack, vllm):
    before = len(stack.engine.utility_calls)
    response = call_on_loop(stack, vllm.FlushCache, common_pb2.FlushCacheRequest(timeout_s=1.0))
    assert response.success and "1 engine" in response.message
    assert len(stack.engine.utility_calls) == before + 1


def test_the_service_is_listed_by_reflection(stack):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def call():
        stub = reflection_pb2_grpc.ServerReflectionStub(stack.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        return [r async for r in stub.ServerReflectionInfo(iter([request]))]
    [response] = stack.run(call())
    assert "vllm.grpc.engine.VllmEngine" in [s.name for s in response.list_services_response.service]
