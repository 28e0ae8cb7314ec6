"""Request caps (n, max_tokens, prompt tokens, stop strings) and message size limits, each with its clear error."""

from __future__ import annotations

import asyncio

import grpc
import grpc_testing
import pytest
from tandem.v1 import common_pb2, engine_core_pb2, engine_core_pb2_grpc, generation_pb2

from engine_core.protocol import EngineInfo
from services.frontend.__main__ import parse_args
from services.frontend.async_llm import AsyncLLM
from services.frontend.engines.client import EngineClient
from services.frontend.errors import EngineUnavailable
from services.frontend.limits import RequestLimits
from services.frontend.server import GenerationServicer
from services.security.transport import ChannelTransport, ServerTransport

SP = common_pb2.SamplingParams
LIMITS = RequestLimits(max_n=4, max_tokens=100, max_prompt_tokens=8, max_stop_strings=2, max_stop_string_chars=10)


class RecordingEngineClient(EngineClient):
    """A connected engine (max_model_len 2048) that records each request, then refuses it as UNAVAILABLE."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = []

    async def start(self): ...
    async def close(self): ...
    async def call_utility(self, method, **kwargs): return []
    async def wait_for_engine(self): return self.engine_info
    def abort(self, request_ids): ...
    def engines(self): return []
    is_connected = admitting = True
    num_in_flight = 0
    engine_info = EngineInfo("fake", "", max_model_len=2048, vocab_size=49152)

    def add_request(self, request):
        self.requests.append(request)
        raise EngineUnavailable("recorded by the test; no engine behind it")


@pytest.fixture
def servicer(tokenizer):
    """GenerationServicer under grpc_testing, over AsyncLLM with LIMITS and a recording engine client."""
    engine = RecordingEngineClient()
    servicer = GenerationServicer(AsyncLLM(engine, tokenizer, limits=LIMITS))

    async def drain(stream):
        return [response async for response in stream]

    def generate(request, context):  # grpc_testing calls servicers synchronously
        return iter(asyncio.run(drain(servicer.Generate(request, context))))

    descriptor = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"]
    server = grpc_testing.server_from_dictionary({descriptor: type("Shell", (), {"Generate": staticmethod(generate)})},
                                                 grpc_testing.strict_real_time())

    def call(request):
        rpc = server.invoke_unary_stream(descriptor.methods_by_name["Generate"], (), request, None)
        _, code, details = rpc.termination()
        return code, details

    return call, engine


def ids(num_tokens: int, **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(range(10, 10 + num_tokens))),
                                          sampling_params=SP(**sampling))


CAPS = [
    (ids(3, n=5), "sampling_params.n must be in [1, 4] (the server's --max-n), got 5"),
    (ids(3, max_tokens=101), "sampling_params.max_tokens must be in [1, 100] (the server's --max-tokens), got 101"),
    (ids(9), "prompt has 9 tokens, at most 8 are allowed (the server's --max-prompt-tokens)"),
    (generation_pb2.GenerateRequest(text="one two three four five six seven eight nine ten"),
     "prompt has 10 tokens, at most 8 are allowed (the server's --max-prompt-tokens)"),
    (ids(3, stop=["a", "b", "c"]), "sampling_params.stop has 3 strings; at most 2 are allowed (the server's "
                                   "--max-stop-strings)"),
    (ids(3, stop=["ok", "x" * 11]), "sampling_params.stop[1] is 11 characters long; at most 10 are allowed (the "
                                    "server's --max-stop-string-length)"),
]


@pytest.mark.parametrize(("request_", "message"), CAPS, ids=[m.split(" (")[0] for _, m in CAPS])
def test_each_cap_is_invalid_argument_naming_field_value_and_flag(servicer, request_, message):
    call, engine = servicer
    code, details = call(request_)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and message in details, details
    assert not engine.requests


def test_requests_at_the_caps_pass_and_unset_max_tokens_gets_the_cap(servicer):
    call, engine = servicer
    code, _ = call(ids(8, n=4, max_tokens=100, stop=["ok", "x" * 10]))
    assert code == grpc.StatusCode.UNAVAILABLE  # reached the (recording) engine
    code, _ = call(ids(8))
    assert code == grpc.StatusCode.UNAVAILABLE
    assert [r.sampling_params.max_tokens for r in engine.requests] == [100, 100]
    assert engine.requests[0].request_id.startswith("0_")  # n=4 fanned out


def test_frontend_flags_set_every_cap():
    args = parse_args(["--max-n", "4", "--max-tokens", "100", "--max-prompt-tokens", "8", "--max-stop-strings", "2",
                       "--max-stop-string-length", "10", "--max-message-bytes", "65536"])
    assert RequestLimits.from_args(args) == LIMITS
    assert args.transport.max_message_bytes == 65536
    assert RequestLimits.from_args(parse_args([])) == RequestLimits()
    with pytest.raises(SystemExit):
        parse_args(["--max-tokens", "0"])


# ---- message size ------------------------------------------------------------------------------
def test_oversize_request_is_resource_exhausted_and_the_frontend_stays_up(make_frontend):
    frontend = make_frontend(ServerTransport(max_message_bytes=64 << 10))
    stub, _ = frontend.stubs(ChannelTransport(max_message_bytes=1 << 20))

    async def run():
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Tokenize(generation_pb2.TokenizeRequest(text="word " * 20_000))
        with pytest.raises(grpc.aio.AioRpcError) as stream_error:
            [r async for r in stub.Generate(generation_pb2.GenerateRequest(text="word " * 20_000))]
        ok = [r async for r in stub.Generate(generation_pb2.GenerateRequest(
            text="hello", sampling_params=SP(max_tokens=3)))]
        return error.value, stream_error.value, ok

    error, stream_error, ok = frontend.run(run())
    for e in (error, stream_error):
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in e.details() and "65536" in e.details(), e.details()
    assert ok[-1].usage.completion_tokens == 3
    assert not frontend.engine.added or all(len(r.prompt_token_ids) < 10 for r in frontend.engine.added.values())


def test_oversize_engine_input_is_resource_exhausted_and_the_engine_stays_up(make_engine):
    engine = make_engine(ServerTransport(max_message_bytes=16 << 10))
    link = ChannelTransport(max_message_bytes=1 << 20)
    huge = engine_core_pb2.EngineCoreInput(add=engine_core_pb2.EngineCoreRequest(
        request_id="huge", prompt_token_ids=[200] * 10_000))
    with link.channel(engine.target) as channel:
        stream = engine_core_pb2_grpc.EngineCoreServiceStub(channel).Connect(iter([huge]), timeout=10)
        with pytest.raises(grpc.RpcError) as error:
            list(stream)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in error.value.details()
    assert engine.info(ChannelTransport()).max_model_len == 96
