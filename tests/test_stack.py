"""The two services as real processes on loopback: frontend -> engine core -> frontend.

A tiny random Llama with SmolLM2's vocabulary size serves most tests (so the real
tokenizer and chat template work on it); one test runs the embedded SmolLM2 itself.
Processes are always stopped, even when a test fails.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import admin_pb2, admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

from clients.local_stack import free_port, wait_until_serving
from engine_core.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.loader import default_model_path
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import SamplingParams
from services.frontend.chat.template import render_chat
from services.frontend.tokenizer import load_tokenizer
from tests.engine_core.tiny_models import write_tiny_model
from tests.services.conftest import engine_stats
from tests.waits import STARTUP_TIMEOUT_S

VOCAB = 49152  # SmolLM2's, so its tokenizer fits the tiny model
MAX_MODEL_LEN = 256
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16",
                "--num-blocks", "600", "--max-num-seqs", "64", "--max-num-batched-tokens", "512"]


class Services:
    """tandem-engine and tandem-frontend subprocesses; the engine can be killed and restarted."""

    def __init__(self, engine_flags: list[str], frontend_flags: list[str]) -> None:
        self.engine_port, self.frontend_port = free_port(), free_port()
        self.engine_flags, self.frontend_flags = engine_flags, frontend_flags
        self.engine: subprocess.Popen | None = None
        self.frontend: subprocess.Popen | None = None
        try:
            self.start_engine()
            self.frontend = self._spawn("services.frontend", "--engine", self.engine_address, "--port",
                                        str(self.frontend_port), "--host", "127.0.0.1", *frontend_flags)
            wait_until_serving(self.frontend_address, STARTUP_TIMEOUT_S, self.frontend)
        except BaseException:
            self.stop()
            raise

    engine_address = property(lambda self: f"127.0.0.1:{self.engine_port}")
    frontend_address = property(lambda self: f"127.0.0.1:{self.frontend_port}")

    @staticmethod
    def _spawn(module: str, *args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.DEVNULL)

    def start_engine(self) -> None:
        self.engine = self._spawn("services.engine", "--host", "127.0.0.1", "--port", str(self.engine_port),
                                  *self.engine_flags)
        wait_until_serving(self.engine_address, STARTUP_TIMEOUT_S, self.engine)

    def kill_engine(self) -> None:
        self.engine.send_signal(signal.SIGKILL)
        self.engine.wait()

    def stop(self) -> None:
        for process in (self.frontend, self.engine):
            if process is not None and process.poll() is None:
                process.terminate()
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-stack"), vocab_size=VOCAB, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def services(tiny_model_dir):
    s = Services(["--model", str(tiny_model_dir), *ENGINE_FLAGS], ["--tokenizer", str(default_model_path())])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks=600), scheduler=SchedulerConfig(max_num_seqs=64),
    ))


def greedy(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                     output_kind=common_pb2.OUTPUT_KIND_DELTA, **kwargs)


async def stream_tokens(stub, request, method="Generate") -> list[int]:
    tokens = []
    async for response in getattr(stub, method)(request):
        for chunk in response.completions:
            tokens.extend(chunk.token_ids)
    return tokens


def wait_for_all_blocks_free(address: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(address)
        if stats.num_free_blocks == stats.num_total_blocks and stats.num_running_reqs == 0:
            return
        assert time.monotonic() < deadline, f"KV blocks still in use: {stats}"
        time.sleep(0.1)


# ---- 1. the same greedy tokens as the offline engine ----------------------------------------------
def test_64_concurrent_streams_match_the_offline_engine(services, offline):
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(10, VOCAB) for _ in range(rng.randrange(3, 60))] for _ in range(64)]
    expected = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))

    async def run():
        async with grpc.aio.insecure_channel(services.frontend_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            requests = [generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=p),
                                                       sampling_params=greedy(12)) for p in prompts]
            return await asyncio.gather(*(stream_tokens(stub, r) for r in requests))

    got = asyncio.run(run())
    assert got == [o.completions[0].token_ids for o in expected]
    wait_for_all_blocks_free(services.engine_address)


def test_chat_streams_the_offline_engine_tokens(services, offline, tokenizer):
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = render_chat(tokenizer.chat_template, messages, bos_token=tokenizer.bos_token,
                         eos_token=tokenizer.eos_token)
    expected = offline.generate([tokenizer.encode(prompt, add_special_tokens=False)],
                                SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))[0]
    request = generation_pb2.ChatRequest(
        messages=[generation_pb2.ChatMessage(role="user", content="Name three colours.")], sampling_params=greedy(16))

    async def run():
        async with grpc.aio.insecure_channel(services.frontend_address) as channel:
            return await stream_tokens(generation_pb2_grpc.GenerationServiceStub(channel), request, "Chat")

    assert asyncio.run(run()) == expected.completions[0].token_ids


# ---- 3. cancel and deadline free every KV block ---------------------------------------------------
def test_cancel_and_deadline_free_every_kv_block(services):
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(range(100, 140))),
                                             sampling_params=greedy(MAX_MODEL_LEN - 41))
    with grpc.insecure_channel(services.frontend_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        keep = admin_pb2.PauseRequest(mode=common_pb2.PAUSE_MODE_KEEP)
        call = stub.Generate(request)
        next(call)  # the stream is running in the engine; frozen there, it cannot finish before the cancel
        assert admin.Pause(keep, timeout=30).ok
        try:
            assert engine_stats(services.engine_address).num_running_reqs == 1
            call.cancel()
            wait_for_all_blocks_free(services.engine_address)
        finally:
            assert admin.Resume(admin_pb2.ResumeRequest(), timeout=30).ok

        # the deadline passes mid-stream while the engine holds the request: no CPU is fast enough to finish first
        call = stub.Generate(request, timeout=3.0)
        next(call)
        assert admin.Pause(keep, timeout=30).ok
        try:
            with pytest.raises(grpc.RpcError) as excinfo:
                for _ in call:
                    pass
            assert excinfo.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            wait_for_all_blocks_free(services.engine_address)
        finally:
            assert admin.Resume(admin_pb2.ResumeRequest(), timeout=30).ok


# ---- 4. engine killed and restarted ------------------------------------------------------------------
def test_engine_killed_then_restarted(services):
    request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=list(range(100, 140))),
                                             sampling_params=greedy(MAX_MODEL_LEN - 41))
    with grpc.insecure_channel(services.frontend_address) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        call = stub.Generate(request)
        next(call)
        services.kill_engine()
        with pytest.raises(grpc.RpcError) as excinfo:
            for _ in call:
                pass
        assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE
        status = health.Check(health_pb2.HealthCheckRequest(service="")).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as excinfo:
            list(stub.Generate(request, timeout=5))
        assert excinfo.value.code() == grpc.StatusCode.UNAVAILABLE

        services.start_engine()  # same port: the frontend reconnects by itself
        wait_until_serving(services.frontend_address, STARTUP_TIMEOUT_S)
        short = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[5, 6, 7]),
                                               sampling_params=greedy(4))
        tokens = [t for response in stub.Generate(short, timeout=30) for c in response.completions for t in c.token_ids]
        assert len(tokens) == 4


# ---- the embedded SmolLM2 through the stack ---------------------------------------------------------
@pytest.mark.slow
def test_smollm2_chat_through_the_stack_says_paris():
    services = Services(["--dtype", "float32", "--max-model-len", "1024"], [])
    try:
        with grpc.insecure_channel(services.frontend_address) as channel:
            stub = generation_pb2_grpc.GenerationServiceStub(channel)
            request = generation_pb2.ChatRequest(
                messages=[generation_pb2.ChatMessage(role="user", content="What is the capital of France?")],
                sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=32,
                                                          output_kind=common_pb2.OUTPUT_KIND_FINAL_ONLY),
            )
            responses = list(stub.Chat(request, timeout=120))
        final = responses[-1].completions[0]
        assert "Paris" in final.text, final.text
        assert final.finish_reason == common_pb2.FINISH_REASON_STOP
        assert responses[-1].usage.completion_tokens == len(final.token_ids)
    finally:
        services.stop()


# ---- 6. health and a reflection-driven call ------------------------------------------------------------
def test_a_call_built_from_reflection_alone(services, tokenizer):
    """What grpcurl does: fetch the service's descriptors from the server, build the request, call."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(services.frontend_address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        names = set(database.get_services())
        assert {"tandem.v1.GenerationService", "tandem.v1.AdminService", "grpc.health.v1.Health"} <= names
        service = descriptor_pool.DescriptorPool(database).FindServiceByName("tandem.v1.GenerationService")
        method = service.methods_by_name["Tokenize"]
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        tokenize = channel.unary_unary("/tandem.v1.GenerationService/Tokenize",
                                       request_serializer=request_class.SerializeToString,
                                       response_deserializer=response_class.FromString)
        reply = tokenize(request_class(text="What is the capital of France?"), timeout=10)
    assert list(reply.token_ids) == tokenizer.encode("What is the capital of France?")
    assert reply.max_model_len == MAX_MODEL_LEN
    for address in (services.frontend_address, services.engine_address):
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="")).status
        assert status == health_pb2.HealthCheckResponse.SERVING
