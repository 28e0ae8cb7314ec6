"""Security test harness: certificates made in the test, a frontend (over a fake engine) and an
engine core (over a tiny random Llama) that listen with a given ServerTransport on 127.0.0.1:0.

Each server runs on its own event loop (`run(coro)` / `call(coro)` execute there); fixtures
stop every server and channel, even when a test fails.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from tandem.v1 import admin_pb2_grpc, engine_core_pb2, engine_core_pb2_grpc, generation_pb2_grpc

from services.frontend.async_llm import AsyncLLM
from services.frontend.engines.grpc_client import GrpcEngineClient
from services.frontend.limits import RequestLimits
from services.frontend.server import FrontendServer
from services.frontend.tokenizer import TokenizerBundle, load_tokenizer
from services.security.tls import channel_credentials
from services.security.transport import ChannelTransport, ServerTransport
from tests.event_loops import close_loop
from tests.frontend.conftest import smollm2_gguf
from tests.frontend.fake_engine import start_fake_engine
from tests.security.pki import Pki, make_pki

WAIT_S = 30.0


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def tokenizer() -> TokenizerBundle:
    return load_tokenizer(smollm2_gguf())


def tls_client(ca, cert=None, key=None, **kwargs) -> ChannelTransport:
    """A TLS ChannelTransport trusting `ca`, with an optional client certificate (mutual TLS)."""
    return ChannelTransport(credentials=channel_credentials(ca, cert, key), **kwargs)


# ---- a frontend over a fake engine --------------------------------------------------------
class Frontend:
    """FakeEngine <- GrpcEngineClient <- AsyncLLM <- FrontendServer(transport), on one event loop."""

    def __init__(self, tokenizer: TokenizerBundle, transport: ServerTransport, limits: RequestLimits) -> None:
        self.loop = asyncio.new_event_loop()
        self.channels: list[grpc.aio.Channel] = []
        self.run(self._start(tokenizer, transport, limits))
        self.target = f"127.0.0.1:{self.server.port}"

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def call(self, make_call):
        """`await make_call()` on this loop (a grpc.aio call must be created inside its loop)."""
        async def call():
            return await make_call()

        return self.run(call())

    async def _start(self, tokenizer, transport, limits) -> None:
        eos = tokenizer.tokenizer.token_to_id(tokenizer.eos_token)
        self.engine_server, port, self.engine = await start_fake_engine(
            vocab_size=tokenizer.vocab_size, model_path=str(smollm2_gguf()), eos_token_id=eos)
        self.client = GrpcEngineClient([f"127.0.0.1:{port}"], backoff_initial_s=0.05, backoff_max_s=0.2)
        await self.client.start()
        await asyncio.wait_for(self.client.wait_for_engine(), WAIT_S)
        self.llm = AsyncLLM(self.client, tokenizer, limits=limits)
        self.server = FrontendServer(self.llm, "127.0.0.1:0", transport=transport)
        await self.server.start()

    def stubs(self, transport: ChannelTransport = ChannelTransport()):
        """(GenerationService, AdminService) stubs on a new channel (made on this loop, closed by close())."""
        async def make():
            return transport.aio_channel(self.target)

        channel = self.run(make())
        self.channels.append(channel)
        return generation_pb2_grpc.GenerationServiceStub(channel), admin_pb2_grpc.AdminServiceStub(channel)

    def close(self) -> None:
        async def stop():
            for channel in self.channels:
                await channel.close()
            await self.server.stop(0)
            await self.client.close()
            await self.engine_server.stop(0)

        try:
            self.run(stop())
        finally:
            close_loop(self.loop)


@pytest.fixture
def make_frontend(tokenizer):
    """make_frontend(transport=..., limits=...) -> Frontend; all closed after the test."""
    frontends: list[Frontend] = []

    def make(transport: ServerTransport = ServerTransport(), limits: RequestLimits = RequestLimits()) -> Frontend:
        frontends.append(Frontend(tokenizer, transport, limits))
        return frontends[-1]

    yield make
    for frontend in frontends:
        frontend.close()


# ---- an engine core over a tiny model --------------------------------------------------------
class EngineThread:
    """An EngineServer(transport) on its own event-loop thread."""

    def __init__(self, config, transport: ServerTransport) -> None:
        from services.engine.server import EngineServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-engine", daemon=True)
        self.thread.start()
        try:
            self.server = EngineServer(config, "127.0.0.1:0", transport=transport)
            self.port = self.call(self.server.start())
        except BaseException:
            self._stop_loop()
            raise
        self.target = f"127.0.0.1:{self.port}"

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    def info(self, transport: ChannelTransport, timeout: float = 10.0) -> engine_core_pb2.GetEngineInfoResponse:
        """GetEngineInfo over a fresh blocking channel."""
        with transport.channel(self.target) as channel:
            stub = engine_core_pb2_grpc.EngineCoreServiceStub(channel)
            return stub.GetEngineInfo(engine_core_pb2.GetEngineInfoRequest(), timeout=timeout)

    def shutdown(self) -> None:
        try:
            self.call(self.server.stop(0))
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        close_loop(self.loop)


@pytest.fixture(scope="session")
def tiny_engine_config(tmp_path_factory):
    from tests.engine_core.tiny_models import write_tiny_model
    from tests.services.conftest import tiny_engine_config

    return tiny_engine_config(write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=256))


@pytest.fixture
def make_engine(tiny_engine_config):
    """make_engine(transport) -> EngineThread; all shut down after the test."""
    engines: list[EngineThread] = []

    def make(transport: ServerTransport) -> EngineThread:
        engines.append(EngineThread(tiny_engine_config, transport))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()
