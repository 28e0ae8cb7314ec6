"""Unit tests without servers: the collector, sampling defaults, a servicer under grpc_testing, import hygiene."""

from __future__ import annotations

import asyncio

import grpc
import grpc_testing
import pytest
from tandem.v1 import common_pb2, engine_core_pb2, generation_pb2

from engine_core.protocol import (
    CompletionOutput,
    FinishReason,
    OutputKind,
    RequestOutput,
    SamplingParams,
    Usage,
    validate_sampling_params,
)
from services.frontend import convert
from services.frontend.async_llm import AsyncLLM
from services.frontend.engines.client import EngineClient, refusal_error
from services.frontend.output_processor import RequestOutputCollector
from services.frontend.server import GenerationServicer, status_for


# ---- collector ----------------------------------------------------------------------
def step(text: str, index: int = 0, finished: bool = False) -> RequestOutput:
    finish = FinishReason.LENGTH if finished else None
    return RequestOutput("r", [CompletionOutput(index, text, [len(text)], finish_reason=finish)], finished=finished,
                         usage=Usage(3, 4, 0) if finished else None)


def test_collector_merges_deltas_for_a_slow_consumer():
    collector = RequestOutputCollector(OutputKind.DELTA)
    for piece in ("Hel", "lo", " wor"):
        collector.put(step(piece))
    collector.put(step("x", index=1))
    collector.put(step("ld", finished=True))
    merged = asyncio.run(collector.get())
    by_index = {c.index: c for c in merged.completions}
    assert by_index[0].text == "Hello world" and by_index[0].token_ids == [3, 2, 4, 2]
    assert by_index[0].finish_reason == FinishReason.LENGTH and by_index[1].text == "x"
    assert merged.finished and merged.usage.completion_tokens == 4
    assert collector.get_nowait() is None


def test_collector_keeps_only_the_latest_cumulative_output():
    collector = RequestOutputCollector(OutputKind.CUMULATIVE)
    for text in ("a", "ab", "abc"):
        collector.put(step(text))
    assert [c.text for c in collector.get_nowait().completions] == ["abc"]


def test_collector_error_replaces_pending_output():
    collector = RequestOutputCollector(OutputKind.DELTA)
    collector.put(step("a"))
    collector.put(RuntimeError("engine gone"))
    with pytest.raises(RuntimeError, match="engine gone"):
        collector.get_nowait()


# ---- sampling defaults --------------------------------------------------------------
def validate_sampling(proto, vocab_size):
    return validate_sampling_params(convert.sampling_params_from_proto(proto), vocab_size=vocab_size)


def test_unset_sampling_fields_get_the_documented_defaults():
    assert validate_sampling(common_pb2.SamplingParams(), vocab_size=100) == SamplingParams()
    params = validate_sampling(common_pb2.SamplingParams(temperature=0, top_k=-1, output_kind=2), vocab_size=100)
    assert (params.temperature, params.top_k, params.output_kind) == (0.0, 0, OutputKind.CUMULATIVE)
    assert SamplingParams(seed=5).for_child(2).seed == 7 and SamplingParams(n=3).for_child(1).n == 1


# ---- a servicer under grpc_testing --------------------------------------------------
class _NoEngine(EngineClient):
    """An engine client with nothing behind it (Tokenize and Detokenize never reach an engine)."""

    async def start(self): ...
    async def close(self): ...
    def add_request(self, request): raise AssertionError("no engine in this test")
    def abort(self, request_ids): ...
    async def call_utility(self, method, **kwargs): return []
    async def wait_for_engine(self): ...
    is_connected = admitting = False
    num_in_flight = 0
    engine_info = None
    def engines(self): return []


class _SyncShell:
    """grpc_testing calls servicers synchronously: run each async method to completion."""

    def __init__(self, servicer) -> None:
        self.servicer = servicer

    def __getattr__(self, name):
        method = getattr(self.servicer, name)
        return lambda request, context: asyncio.run(method(request, context))


@pytest.fixture
def generation_server(tokenizer):
    servicer = _SyncShell(GenerationServicer(AsyncLLM(_NoEngine(), tokenizer)))
    descriptor = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    return grpc_testing.server_from_dictionary({descriptor: servicer}, grpc_testing.strict_real_time()), descriptor


def call_unary(server_and_descriptor, method: str, request):
    server, descriptor = server_and_descriptor
    rpc = server.invoke_unary_unary(descriptor.methods_by_name[method], (), request, None)
    response, _, code, details = rpc.termination()
    return response, code, details


def test_tokenize_servicer(generation_server, tokenizer):
    response, code, _ = call_unary(generation_server, "Tokenize", generation_pb2.TokenizeRequest(text="Hi you"))
    assert code == grpc.StatusCode.OK and list(response.token_ids) == tokenizer.encode("Hi you")
    assert list(response.tokens) == [tokenizer.tokenizer.id_to_token(i) for i in response.token_ids]


def test_tokenize_servicer_rejects_bad_chat(generation_server):
    chat = generation_pb2.ChatRequest(messages=[generation_pb2.ChatMessage(role="robot", content="x")])
    _, code, details = call_unary(generation_server, "Tokenize", generation_pb2.TokenizeRequest(chat=chat))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "messages[0].role" in details


def test_detokenize_servicer(generation_server, tokenizer):
    ids = tokenizer.encode("<|im_start|>user", add_special_tokens=False)
    response, code, _ = call_unary(generation_server, "Detokenize",
                                   generation_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=False))
    assert code == grpc.StatusCode.OK and response.text == "<|im_start|>user"
    _, code, details = call_unary(generation_server, "Detokenize", generation_pb2.DetokenizeRequest(token_ids=[-3]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "token_ids[0] = -3" in details


def test_an_engine_refusing_while_asleep_is_unavailable_and_bad_input_stays_invalid_argument():
    batch = engine_core_pb2.EngineCoreOutputs(errors=[
        engine_core_pb2.RequestError(request_id="a", message="the engine is asleep until WakeUp",
                                     kind=engine_core_pb2.REQUEST_ERROR_KIND_ASLEEP),
        engine_core_pb2.RequestError(request_id="b", message="the prompt is too long")])  # kind unset: bad input
    asleep, bad = (refusal_error(error) for error in convert.message_from_proto(batch).errors)
    assert status_for(asleep) == grpc.StatusCode.UNAVAILABLE and "tandem admin wake" in str(asleep)
    assert status_for(bad) == grpc.StatusCode.INVALID_ARGUMENT and "the prompt is too long" in str(bad)

