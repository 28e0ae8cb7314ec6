"""A real engine server (tiny random Llama) and a real frontend in one process, with telemetry wired.

The engine runs on its own event loop thread; the frontend, its /metrics server and the test's
gRPC client run on the test's loop (`stack.run(coro)`). Spans from both services go to one
in-memory exporter (each service keeps its own tracer provider, as in production). Everything
is shut down by the fixture, even when a test fails.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.request

import grpc
import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families
from tandem.v1 import admin_pb2_grpc, common_pb2, generation_pb2, generation_pb2_grpc

from services.engine.server import EngineServer
from services.frontend.async_llm import AsyncLLM
from services.frontend.engines.grpc_client import GrpcEngineClient
from services.frontend.server import FrontendServer
from services.frontend.telemetry import FrontendTelemetry
from services.frontend.tokenizer import load_tokenizer
from services.telemetry.metrics import FrontendMetrics, MetricsServer
from services.telemetry.tracing import TracingSettings, setup_tracing, shutdown_tracing
from tests.engine_core.tiny_models import write_tiny_model
from tests.event_loops import close_loop
from tests.frontend.conftest import smollm2_gguf
from tests.services.conftest import tiny_engine_config

WAIT_S = 60.0


class EngineThread:
    """An EngineServer (with telemetry) on its own event loop thread."""

    def __init__(self, config, **server_kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-engine", daemon=True)
        self.thread.start()
        self.server = EngineServer(config, "127.0.0.1:0", **server_kwargs)
        self.port = self._call(self.server.start())
        self.target = f"127.0.0.1:{self.port}"
        self.stopped = False

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    def shutdown(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        try:
            self._call(self.server.stop(0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(WAIT_S)
            close_loop(self.loop)


class ObservedStack:
    """Engine + frontend + client stubs; `tracing` and `metrics` switch each part of the telemetry."""

    def __init__(self, tokenizer, engine_config, *, tracing: bool, metrics: bool) -> None:
        self.exporter = InMemorySpanExporter()
        self.providers = [
            setup_tracing(TracingSettings(tracing, service_name=name), SimpleSpanProcessor(self.exporter))
            for name in ("tandem-engine", "tandem-frontend")
        ]
        self.loop = asyncio.new_event_loop()
        self.engine: EngineThread | None = None
        self.frontend: FrontendServer | None = None
        self.metrics_server: MetricsServer | None = None
        self.client: GrpcEngineClient | None = None
        self.channel = None
        try:
            self.engine = EngineThread(engine_config, tracer_provider=self.providers[0],
                                       metrics_port=0 if metrics else None)
            self.run(self._start(tokenizer, metrics))
        except BaseException:
            self.close()
            raise

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def _start(self, tokenizer, metrics: bool) -> None:
        self.client = GrpcEngineClient([self.engine.target], backoff_initial_s=0.05, backoff_max_s=0.2)
        await self.client.start()
        await asyncio.wait_for(self.client.wait_for_engine(), WAIT_S)
        frontend_metrics = FrontendMetrics() if metrics else None
        self.telemetry = FrontendTelemetry(self.providers[1], frontend_metrics)
        self.llm = AsyncLLM(self.client, tokenizer, telemetry=self.telemetry)
        self.frontend = FrontendServer(self.llm, "127.0.0.1:0")
        await self.frontend.start()
        if frontend_metrics is not None:
            self.metrics_server = MetricsServer(frontend_metrics.registry, "127.0.0.1", 0)
            self.metrics_server.start()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.frontend.port}")
        self.stub = generation_pb2_grpc.GenerationServiceStub(self.channel)
        self.admin = admin_pb2_grpc.AdminServiceStub(self.channel)

    # ---- calls ----------------------------------------------------------------------------
    def generate_request(self, prompt: list[int], max_tokens: int, request_id: str = "",
                         **params) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            request_id=request_id, token_ids=generation_pb2.TokenIds(ids=prompt),
            sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))

    async def generate(self, prompt: list[int], max_tokens: int, *, metadata=(), request_id: str = "",
                       **params) -> list[generation_pb2.GenerateResponse]:
        call = self.stub.Generate(self.generate_request(prompt, max_tokens, request_id, **params), metadata=metadata)
        return [response async for response in call]

    # ---- metrics --------------------------------------------------------------------------
    def scrape(self, service: str) -> dict[tuple[str, frozenset], float]:
        """GET /metrics of "engine" or "frontend": {(sample name, labels): value}."""
        port = self.engine.server.metrics_port if service == "engine" else self.metrics_server.port
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        return {(sample.name, frozenset(sample.labels.items())): sample.value
                for family in text_string_to_metric_families(text) for sample in family.samples}

    # ---- teardown -------------------------------------------------------------------------
    async def _stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.frontend is not None:
            await self.frontend.stop(0)
        if self.client is not None:
            await self.client.close()

    def close(self) -> None:
        try:
            self.run(self._stop())
        finally:
            try:
                if self.metrics_server is not None:
                    self.metrics_server.stop()
                if self.engine is not None:
                    self.engine.shutdown()
            finally:
                close_loop(self.loop)
                for provider in self.providers:
                    shutdown_tracing(provider)


def metric(samples: dict, name: str, **labels) -> float:
    """The sum of the samples called `name` whose labels include `labels` (0 when there is none)."""
    wanted = set(labels.items())
    return sum(value for (sample, sample_labels), value in samples.items()
               if sample == name and wanted <= sample_labels)


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(smollm2_gguf())


@pytest.fixture(scope="session")
def observed_engine_config(tmp_path_factory):
    return tiny_engine_config(write_tiny_model(tmp_path_factory.mktemp("tiny-llama-obs"),
                                               max_position_embeddings=256))


@pytest.fixture
def make_stack(tokenizer, observed_engine_config):
    """make_stack(tracing=..., metrics=..., engine_config=...) -> ObservedStack; all closed after the test."""
    stacks: list[ObservedStack] = []

    def make(*, tracing: bool = False, metrics: bool = False, engine_config=None) -> ObservedStack:
        stacks.append(ObservedStack(tokenizer, engine_config or observed_engine_config, tracing=tracing,
                                    metrics=metrics))
        return stacks[-1]

    yield make
    for stack in stacks:
        stack.close()
