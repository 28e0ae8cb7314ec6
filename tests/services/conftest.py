"""Fixtures: a real engine-core gRPC server on 127.0.0.1:0 over a tiny random Llama, and stream clients.

The server runs on its own asyncio loop in a background thread, so tests use the plain
(sync) grpc client. Every server and stream is shut down in a finalizer, even when a test fails.
"""

from __future__ import annotations

import asyncio
import queue
import threading

import grpc
import pytest
from tandem.v1 import engine_core_pb2, engine_core_pb2_grpc

from engine_core.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine_core.offline.llm_engine import LLMEngine
from engine_core.protocol import SamplingParams
from services.engine.server import EngineServer
from tests.engine_core.tiny_models import write_tiny_model
from tests.event_loops import close_loop

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
WAIT_S = 30.0


def tiny_engine_config(folder) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(folder), dtype="float32", max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=32),
        device=DeviceConfig(device="cpu", attention_backend="torch"),
    )


class ServerThread:
    """An EngineServer on its own event loop thread; `call()` runs a coroutine there."""

    def __init__(self, config: EngineConfig, stall_timeout: float = 30.0) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-engine-server", daemon=True)
        self.thread.start()
        self.server = EngineServer(config, "127.0.0.1:0", stall_timeout=stall_timeout)
        self.port = self.call(self.server.start())
        self.target = f"127.0.0.1:{self.port}"
        self._stopped = False

    def call(self, coro, timeout: float = WAIT_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float | None = 0) -> None:
        if not self._stopped:
            self._stopped = True
            self.call(self.server.stop(grace))

    def shutdown(self) -> None:
        try:
            self.stop()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(WAIT_S)
            close_loop(self.loop)


class Stream:
    """One Connect stream: `send()` inputs; a pump thread folds every output into per-request state."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._inputs: queue.Queue = queue.Queue()
        self._responses = engine_core_pb2_grpc.EngineCoreServiceStub(channel).Connect(iter(self._inputs.get, None))
        self._cond = threading.Condition()
        self._call_ids = iter(range(1, 1 << 30))
        self.messages: list[engine_core_pb2.EngineCoreOutputs] = []
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, int] = {}  # request id -> proto FinishReason
        self.errors: dict[str, str] = {}
        self.error_kinds: dict[str, int] = {}  # request id -> proto RequestErrorKind
        self.states: list[engine_core_pb2.EngineState] = []  # every engine state the stream was told, in order
        self.results: dict[int, engine_core_pb2.UtilityResult] = {}
        self.rpc_error: grpc.RpcError | None = None
        self.ended = False
        self._pump = threading.Thread(target=self._run, daemon=True)
        self._pump.start()

    def _run(self) -> None:
        try:
            for message in self._responses:
                with self._cond:
                    self._fold(message)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            self.rpc_error = exc
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def _fold(self, message: engine_core_pb2.EngineCoreOutputs) -> None:
        self.messages.append(message)
        for output in message.outputs:
            self.tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finish_reason:
                self.finish[output.request_id] = output.finish_reason
        for error in message.errors:
            self.errors[error.request_id] = error.message
            self.error_kinds[error.request_id] = error.kind
        if message.HasField("engine_state"):
            self.states.append(message.engine_state)
        if message.HasField("utility_result"):
            self.results[message.utility_result.call_id] = message.utility_result

    # ---- inputs
    def send(self, **kind) -> None:
        self._inputs.put(engine_core_pb2.EngineCoreInput(**kind))

    def add(self, request_id: str, prompt: list[int], **params) -> None:
        self.send(add=engine_core_pb2.EngineCoreRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling_params=params))

    def abort(self, *request_ids: str) -> None:
        self.send(abort=engine_core_pb2.AbortRequests(request_ids=request_ids))

    def utility(self, call: str | engine_core_pb2.UtilityCall, **fields) -> int:
        """Send a utility call: an arm of UtilityCall.call by name ("pause") with its message's fields, or a whole
        UtilityCall (its call_id is set here)."""
        call_id = next(self._call_ids)
        message = engine_core_pb2.UtilityCall(**{call: fields}) if isinstance(call, str) else call
        message.call_id = call_id
        self.send(utility=message)
        return call_id

    def call(self, call: str | engine_core_pb2.UtilityCall, **fields) -> engine_core_pb2.UtilityResult:
        call_id = self.utility(call, **fields)
        return self.wait(lambda: self.results.get(call_id))

    def stats(self) -> engine_core_pb2.SchedulerStats:
        return self.call("get_stats").stats

    # ---- waiting
    def wait(self, predicate, timeout: float = WAIT_S):
        with self._cond:
            self._cond.wait_for(lambda: predicate() or self.ended, timeout)
            value = predicate()
            assert value, f"timed out or the stream ended (rpc error: {self.rpc_error})"
            return value

    def wait_finished(self, *request_ids: str) -> dict[str, list[int]]:
        self.wait(lambda: all(r in self.finish for r in request_ids))
        return {r: self.tokens.get(r, []) for r in request_ids}

    def close(self) -> None:
        """Half-close: the server treats the end of inputs as the client going away."""
        self._inputs.put(None)

    def cancel(self) -> None:
        self._responses.cancel()


def engine_stats(address: str) -> engine_core_pb2.SchedulerStats:
    """A running engine's scheduler stats, over a Connect stream of our own (a GetStatsCall)."""
    with grpc.insecure_channel(address) as channel:
        stream = Stream(channel)
        try:
            return stream.stats()
        finally:
            stream.close()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), max_position_embeddings=256)


@pytest.fixture(scope="session")
def engine_config(tiny_model_dir) -> EngineConfig:
    return tiny_engine_config(tiny_model_dir)


@pytest.fixture(scope="module")
def engine_server(engine_config):
    """One server shared by a module's tests; each test leaves it idle, resumed and awake."""
    server = ServerThread(engine_config)
    yield server
    server.shutdown()


@pytest.fixture
def make_server(engine_config):
    """A fresh server per call (for tests that break or stop it); all shut down afterwards."""
    servers: list[ServerThread] = []

    def make(**kwargs) -> ServerThread:
        servers.append(ServerThread(engine_config, **kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.shutdown()


@pytest.fixture
def connect():
    """connect(target) -> Stream on a new channel; every stream and channel closed afterwards."""
    opened: list[tuple[grpc.Channel, Stream]] = []

    def make(target: str) -> Stream:
        channel = grpc.insecure_channel(target)
        opened.append((channel, Stream(channel)))
        return opened[-1][1]

    yield make
    for channel, stream in opened:
        stream.cancel()
        channel.close()


@pytest.fixture(scope="module")
def offline(engine_config):
    """offline(prompts, max_tokens=None, ignore_eos=False) -> greedy token lists from LLMEngine."""
    engine = LLMEngine(engine_config)

    def run(batch, max_tokens=None, ignore_eos=False):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        return [output.completions[0].token_ids for output in engine.generate(batch, params)]

    return run
