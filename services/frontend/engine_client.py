"""The frontend's link to engine cores: one long-lived Connect stream per engine address.

`EngineClient` is the interface AsyncLLM uses; `GrpcEngineClient` implements it over
gRPC for one or many engines, `in_process.InProcessEngineClient` over an engine busy
loop of this process.

The engine client only routes: requests and aborts to engines, utility answers to their
callers, and every engine step (or lost request) onto one queue that AsyncLLM's output
handler reads with `get_output()` (vLLM v1's shape).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import grpc
from tandem.v1 import engine_core_pb2_grpc

from services.frontend import convert
from services.frontend.errors import EngineUnavailable, InvalidRequest
from services.frontend.messages import (
    EngineInfo,
    EngineMessage,
    EngineOutputs,
    EngineRequest,
    EngineStatus,
    UtilityResult,
)
from services.security.transport import ENGINE_LINK_MAX_MESSAGE_BYTES, ChannelTransport

log = logging.getLogger(__name__)

PLAINTEXT_LINK = ChannelTransport(max_message_bytes=ENGINE_LINK_MAX_MESSAGE_BYTES)


class EngineClient(ABC):
    """Adds and aborts engine requests, makes utility calls, and queues engine outputs for `get_output()`."""

    def __init__(self) -> None:
        self._outputs: asyncio.Queue[EngineOutputs] = asyncio.Queue()
        self._listeners: list[Callable[[], None]] = []

    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...

    @abstractmethod
    def add_request(self, request: EngineRequest) -> None:
        """Send a request to an engine (never blocks); raises EngineUnavailable when none is connected."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests (never blocks; unknown ids are ignored)."""

    @abstractmethod
    async def call_utility(self, method: str, *, pause_mode: str = "", profile_dir: str = "") -> list[UtilityResult]:
        """Call `method` (pause, resume, sleep, wake_up, reset_prefix_cache, start_profile, ...) on every engine."""

    @abstractmethod
    async def wait_for_engine(self) -> EngineInfo:
        """Wait until an engine is connected; its model info."""

    @property
    @abstractmethod
    def is_connected(self) -> bool: ...

    @property
    @abstractmethod
    def num_in_flight(self) -> int:
        """Engine requests sent and not yet finished, aborted or lost."""

    @property
    @abstractmethod
    def engine_info(self) -> EngineInfo | None: ...

    @abstractmethod
    def engines(self) -> list[EngineStatus]: ...

    async def get_output(self) -> EngineOutputs:
        """The next engine step's outputs, or requests that failed (AsyncLLM's output handler is the reader)."""
        return await self._outputs.get()

    def _put_output(self, outputs: EngineOutputs) -> None:
        self._outputs.put_nowait(outputs)

    def add_listener(self, callback: Callable[[], None]) -> None:
        """`callback()` runs whenever an engine connects or disconnects."""
        self._listeners.append(callback)

    def remove_listener(self, callback: Callable[[], None]) -> None:
        self._listeners.remove(callback)

    def _notify(self) -> None:
        for callback in self._listeners:
            callback()


class _Engine:
    """One engine address: its channel, its current stream and the engine request ids in flight on it."""

    def __init__(self, address: str, transport: ChannelTransport) -> None:
        self.address = address
        self.channel = transport.aio_channel(address)
        self.stub = engine_core_pb2_grpc.EngineCoreServiceStub(self.channel)
        self.info: EngineInfo | None = None
        self.queue: asyncio.Queue | None = None  # inputs for the current stream; None: not connected
        self.in_flight: set[str] = set()  # the client's only record of what is in flight
        self.pending: dict[int, asyncio.Future] = {}  # utility call id -> result
        self.task: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        return self.queue is not None

    def send(self, message) -> None:
        self.queue.put_nowait(message)


class GrpcEngineClient(EngineClient):
    """Engine cores over gRPC: reconnects with capped exponential backoff, routes to the least loaded.

    `transport` says how to reach the engines (plaintext by default; TLS / mutual TLS from the
    frontend's --engine-tls-* flags).
    """

    def __init__(self, addresses: list[str], *, backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0,
                 info_timeout_s: float = 5.0, transport: ChannelTransport = PLAINTEXT_LINK) -> None:
        super().__init__()
        self._engines = [_Engine(address, transport) for address in addresses]
        self._call_ids = itertools.count(1)
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._info_timeout_s = info_timeout_s
        self._connected = asyncio.Event()
        self._closed = False

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        for engine in self._engines:
            engine.task = asyncio.create_task(self._run(engine), name=f"engine {engine.address}")

    async def close(self) -> None:
        self._closed = True
        for engine in self._engines:
            if engine.task is not None:
                engine.task.cancel()
        await asyncio.gather(*(e.task for e in self._engines if e.task), return_exceptions=True)
        for engine in self._engines:
            await engine.channel.close()

    async def wait_for_engine(self) -> EngineInfo:
        await self._connected.wait()
        return self.engine_info

    # ---- state ----------------------------------------------------------------------
    @property
    def is_connected(self) -> bool:
        return any(e.connected for e in self._engines)

    @property
    def num_in_flight(self) -> int:
        return sum(len(e.in_flight) for e in self._engines)

    @property
    def engine_info(self) -> EngineInfo | None:
        infos = [e.info for e in self._engines if e.connected and e.info]
        return min(infos, key=lambda info: info.max_model_len) if infos else None

    def engines(self) -> list[EngineStatus]:
        return [EngineStatus(e.address, e.connected, len(e.in_flight)) for e in self._engines]

    # ---- requests -------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        connected = [e for e in self._engines if e.connected]
        if not connected:
            addresses = ", ".join(e.address for e in self._engines)
            raise EngineUnavailable(f"no engine is connected (engines: {addresses}); they may be starting or down, "
                                    "retry shortly")
        engine = min(connected, key=lambda e: len(e.in_flight))
        engine.in_flight.add(request.request_id)
        engine.send(convert.request_to_proto(request))

    def abort(self, request_ids: list[str]) -> None:
        for engine in self._engines:
            ids = [request_id for request_id in request_ids if request_id in engine.in_flight]
            engine.in_flight.difference_update(ids)
            if ids and engine.connected:
                engine.send(convert.abort_to_proto(ids))

    async def call_utility(self, method: str, *, pause_mode: str = "", profile_dir: str = "") -> list[UtilityResult]:
        engines = [e for e in self._engines if e.connected]
        if not engines:
            raise EngineUnavailable("no engine is connected; the call reached no engine")
        calls = []
        for engine in engines:
            call_id = next(self._call_ids)
            engine.pending[call_id] = future = asyncio.get_running_loop().create_future()
            engine.send(convert.utility_to_proto(call_id, method, pause_mode, profile_dir))
            calls.append(future)
        return list(await asyncio.gather(*calls))

    # ---- one engine's connection loop -----------------------------------------------
    async def _run(self, engine: _Engine) -> None:
        delay = self._backoff[0]
        while not self._closed:
            try:
                info = await engine.stub.GetEngineInfo(convert.engine_info_request(), timeout=self._info_timeout_s)
            except grpc.aio.AioRpcError as e:
                log.debug("engine at %s not reachable (%s); retrying in %.1fs", engine.address, e.code().name, delay)
                await asyncio.sleep(delay)
                delay = min(2 * delay, self._backoff[1])
                continue
            delay = self._backoff[0]
            reason = await self._serve(engine, convert.engine_info_from_proto(info))
            if self._closed:
                return
            log.warning("engine at %s disconnected (%s); reconnecting", engine.address, reason)
            await asyncio.sleep(delay)

    async def _serve(self, engine: _Engine, info: EngineInfo) -> str:
        """Hold one Connect stream open until it breaks; returns why it ended."""
        queue: asyncio.Queue = asyncio.Queue()
        call = engine.stub.Connect(_stream_inputs(queue))
        engine.info, engine.queue = info, queue
        log.info("connected to engine at %s (model %s, max_model_len %d)", engine.address, info.model_name,
                 info.max_model_len)
        self._on_change()
        try:
            async for batch in call:
                self._route(engine, convert.message_from_proto(batch))
            reason = "the engine closed the stream"
        except grpc.aio.AioRpcError as e:
            reason = f"{e.code().name}: {e.details()}"
        except Exception as e:  # a bug while converting outputs: drop this stream, keep reconnecting
            log.exception("error while reading outputs from engine at %s", engine.address)
            reason = f"frontend error {e!r}"
        finally:
            queue.put_nowait(None)
            call.cancel()
            engine.queue = None
            self._on_lost(engine, reason)
        return reason

    def _route(self, engine: _Engine, message: EngineMessage) -> None:
        """Utility answers to their callers; refusals and outputs to the output handler."""
        if message.utility_call_id is not None:
            future = engine.pending.pop(message.utility_call_id, None)
            if future is not None and not future.done():
                future.set_result(UtilityResult(engine.address, message.utility_ok, message.utility_error))
        for error in message.errors:
            engine.in_flight.discard(error.request_id)
            self._put_output(EngineOutputs(
                failed=[error.request_id], error=InvalidRequest(f"the engine refused the request: {error.message}")))
        if message.outputs:
            engine.in_flight.difference_update(o.request_id for o in message.outputs if o.finish_reason is not None)
            self._put_output(EngineOutputs(outputs=message.outputs))

    def _on_lost(self, engine: _Engine, reason: str) -> None:
        """Every request in flight on this engine ends with UNAVAILABLE; pending utility calls fail."""
        lost = list(engine.in_flight)
        engine.in_flight.clear()
        if lost:
            error = EngineUnavailable(f"engine at {engine.address} disconnected ({reason}); retry the request")
            self._put_output(EngineOutputs(failed=lost, error=error))
        for future in engine.pending.values():
            if not future.done():
                future.set_result(UtilityResult(engine.address, False, f"engine at {engine.address} disconnected"))
        engine.pending.clear()
        self._on_change()

    def _on_change(self) -> None:
        if self.is_connected:
            self._connected.set()
        else:
            self._connected.clear()
        self._notify()


async def _stream_inputs(queue: asyncio.Queue):
    """The Connect request stream: whatever is put on the queue, until None."""
    while (message := await queue.get()) is not None:
        yield message
