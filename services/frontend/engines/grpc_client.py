"""The frontend's link to engine cores: one long-lived Connect stream per engine address.

`EngineClient` (client.py) is the interface AsyncLLM uses; `GrpcEngineClient`
implements it over gRPC for one or many engines (found by discovery, chosen by the router),
`in_process.InProcessEngineClient` over an engine busy loop of this process.

The engine client only routes: requests and aborts to engines, utility answers to their
callers, and every engine step (or lost request) onto one queue that AsyncLLM's output
handler reads with `get_output()` (vLLM v1's shape).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging

import grpc

from engine_core.protocol import (
    ControlCall,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineState,
    KVCacheEvents,
    SchedulerStats,
    UtilityCall,
)
from services.frontend import convert
from services.frontend.engines.client import (
    EngineCallResult,
    EngineClient,
    EngineStatus,
    with_adapter,
)
from services.frontend.engines.connection import EngineConnection
from services.frontend.engines.discovery import (
    DEFAULT_RESOLVE_INTERVAL_S,
    EngineDiscovery,
    Resolver,
    parse_engine_targets,
)
from services.frontend.engines.router import Router
from services.frontend.errors import EngineAsleep, EngineUnavailable
from services.security.transport import ENGINE_LINK_MAX_MESSAGE_BYTES, ChannelTransport
from services.telemetry.metrics import FrontendMetrics

log = logging.getLogger(__name__)

PLAINTEXT_LINK = ChannelTransport(max_message_bytes=ENGINE_LINK_MAX_MESSAGE_BYTES)


class GrpcEngineClient(EngineClient):
    """Engine cores over gRPC: one Connect stream per engine address, each reconnecting with capped
    exponential backoff; each request goes where the router says (services/frontend/engines/router.py).

    `targets` are --engine values: `host:port` or `dns:///name:port`, the latter resolved to every
    address behind the name on an interval and when a stream breaks (engine_discovery.py). Engines
    that appear are connected; engines that disappear retire: no new requests, closed once their
    requests in flight are done. `transport` says how to reach the engines (plaintext by default;
    TLS / mutual TLS from the frontend's --engine-tls-* flags).
    """

    def __init__(self, targets: list[str], *, backoff_initial_s: float = 0.1, backoff_max_s: float = 5.0,
                 info_timeout_s: float = 5.0, transport: ChannelTransport = PLAINTEXT_LINK,
                 router: Router | None = None, resolver: Resolver | None = None,
                 resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
                 metrics: FrontendMetrics | None = None) -> None:
        super().__init__()
        self._transport = transport
        self._engines: dict[str, EngineConnection] = {}
        self._discovery = EngineDiscovery(parse_engine_targets(targets), self._on_addresses, resolver=resolver,
                                          interval_s=resolve_interval_s)
        self.router = router or Router()
        self._metrics = metrics
        if metrics is not None:
            metrics.track_engines(lambda: [(e.address, len(e.in_flight)) for e in self._engines.values()])
        self._call_ids = itertools.count(1)
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._info_timeout_s = info_timeout_s
        self._connected = asyncio.Event()
        self._retired: set[asyncio.Task] = set()  # retired engines' closing tasks (held: the loop keeps weak refs)
        self._started = self._closed = False
        self._last_stats: dict[str, SchedulerStats] = {}  # per engine address: what a new report listener starts from

    # ---- lifecycle ------------------------------------------------------------------
    async def start(self) -> None:
        self._started = True
        await self._discovery.start()  # its first answer starts the engines' connection loops

    async def close(self) -> None:
        self._closed = True
        await self._discovery.close()
        await asyncio.gather(*(engine.close() for engine in self._engines.values()), *self._retired)

    async def wait_for_engine(self) -> EngineInfo:
        await self._connected.wait()
        return self.engine_info

    # ---- engines coming and going ---------------------------------------------------
    def _on_addresses(self, addresses: list[str]) -> None:
        """Discovery's answer changed: connect new engines, retire departed ones (un-retire returning ones)."""
        wanted = set(addresses)
        for address in addresses:
            engine = self._engines.get(address)
            if engine is None:
                engine = self._engines[address] = EngineConnection(address, self._transport_to(address))
                log.info("engine %s discovered", address)
                if self._started:
                    self._start_engine(engine)
            elif engine.retiring:
                engine.retiring = False
                log.info("engine %s is back in discovery; routing to it again", address)
        for engine in [e for e in self._engines.values() if e.address not in wanted and not e.retiring]:
            engine.retiring = True
            log.info("engine %s left discovery: no new requests; %d in flight finish there",
                     engine.address, len(engine.in_flight))
            self._retire_if_idle(engine)
        self._on_change()

    def _transport_to(self, address: str) -> ChannelTransport:
        """TLS to an address found by DNS verifies the DNS name (unless --engine-tls-server-name says otherwise)."""
        name = self._discovery.names.get(address)
        if self._transport.credentials is None or self._transport.server_name or name is None:
            return self._transport
        return dataclasses.replace(self._transport, server_name=name)

    def _start_engine(self, engine: EngineConnection) -> None:
        engine.task = asyncio.create_task(self._run(engine), name=f"engine {engine.address}")

    def _retire_if_idle(self, engine: EngineConnection) -> None:
        """Close a retiring engine once nothing of ours is in flight there."""
        if engine.retiring and engine.idle and self._engines.get(engine.address) is engine:
            del self._engines[engine.address]
            log.info("engine %s retired", engine.address)
            closing = asyncio.ensure_future(engine.close())
            self._retired.add(closing)
            closing.add_done_callback(self._retired.discard)
            self._on_change()

    # ---- state ----------------------------------------------------------------------
    @property
    def is_connected(self) -> bool:
        return any(e.routable for e in self._engines.values())

    @property
    def admitting(self) -> bool:
        return any(e.admitting for e in self._engines.values())

    @property
    def num_in_flight(self) -> int:
        return sum(len(e.in_flight) for e in self._engines.values())

    @property
    def engine_info(self) -> EngineInfo | None:
        infos = [e.info for e in self._engines.values() if e.connected and e.info]
        return min(infos, key=lambda info: info.max_model_len) if infos else None

    def engines(self) -> list[EngineStatus]:
        return [EngineStatus(e.address, e.connected, len(e.in_flight), e.state) for e in self._engines.values()]

    def add_report_listener(self, listener) -> None:
        """A listener added after engines connected starts from each one's prefix cache and load as known now."""
        for engine in self._engines.values():
            if engine.connected:
                listener(engine.address, engine.load.block_size, self._last_stats.get(engine.address),
                         engine.load.prefix.snapshot())
        super().add_report_listener(listener)

    # ---- requests -------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> None:
        candidates = with_adapter(self._candidates(), request.lora_name)
        decision = self.router.choose([e.load for e in candidates], request.prompt_token_ids, request.lora_name)
        engine = candidates[decision.index]
        engine.track(request.request_id, decision.prefix_hashes)
        engine.send(convert.request_to_proto(request))
        if self._metrics is not None:
            policy = self.router.policy.value
            self._metrics.router_prefix_hit_tokens.labels(policy).inc(decision.matched_tokens)
            self._metrics.router_prompt_tokens.labels(policy).inc(len(request.prompt_token_ids))

    def _candidates(self) -> list[EngineConnection]:
        """The engines a new request may go to: those that start it now; when every one is paused, the paused
        ones (it waits there until Resume, as it would in vLLM and SGLang); never a sleeping one."""
        routable = [e for e in self._engines.values() if e.routable]
        if not routable:
            targets = ", ".join(str(t) for t in self._discovery.targets)
            raise EngineUnavailable(f"no engine is connected (engines: {targets}); they may be starting or down, "
                                    "retry shortly")
        awake = [e for e in routable if not e.state.asleep]
        if not awake:
            raise EngineAsleep()
        return [e for e in awake if not e.state.paused] or awake

    def abort(self, request_ids: list[str]) -> None:
        for engine in list(self._engines.values()):
            ids = engine.untrack(request_ids)
            if ids and engine.connected:
                engine.send(convert.abort_to_proto(ids))
            self._retire_if_idle(engine)

    async def call_utility(self, call: ControlCall) -> list[EngineCallResult]:
        engines = [e for e in self._engines.values() if e.connected]
        if not engines:
            raise EngineUnavailable("no engine is connected; the call reached no engine")
        calls = []
        for engine in engines:
            call_id = next(self._call_ids)
            engine.pending[call_id] = future = asyncio.get_running_loop().create_future()
            engine.send(convert.utility_to_proto(UtilityCall(call_id, call)))
            calls.append(future)
        return list(await asyncio.gather(*calls))

    # ---- one engine's connection loop -----------------------------------------------
    async def _run(self, engine: EngineConnection) -> None:
        delay = self._backoff[0]
        while not self._closed and self._engines.get(engine.address) is engine:
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
            self._discovery.refresh()  # it may have moved or gone
            await asyncio.sleep(delay)

    async def _serve(self, engine: EngineConnection, info: EngineInfo) -> str:
        """Hold one Connect stream open until it breaks; returns why it ended."""
        queue: asyncio.Queue = asyncio.Queue()
        call = engine.stub.Connect(_stream_inputs(queue))
        engine.opened(queue, info)
        log.info("connected to engine at %s (model %s, max_model_len %d)", engine.address, info.model_name,
                 info.max_model_len)
        self._on_change()
        reason = "the frontend closed the stream"
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
            self._on_lost(engine, reason)
        return reason

    def _route(self, engine: EngineConnection, message: EngineCoreOutputs) -> None:
        """Utility answers to their callers; refusals and outputs to the output handler; load to the router;
        a new engine state to the listeners (health)."""
        engine.observe(message.scheduler_stats, message.kv_events)
        if message.scheduler_stats is not None:
            self._last_stats[engine.address] = message.scheduler_stats
        if message.scheduler_stats is not None or message.kv_events is not None:
            for listener in self.report_listeners:
                listener(engine.address, engine.load.block_size, message.scheduler_stats, message.kv_events)
        if message.engine_state is not None and message.engine_state != engine.state:
            engine.state = message.engine_state
            log.info("engine at %s: %s", engine.address, _describe(engine.state))
            self._on_change()
        self._deliver(engine.address, message, engine.pending, engine.untrack)
        self._retire_if_idle(engine)

    def _on_lost(self, engine: EngineConnection, reason: str) -> None:
        """Every request in flight on this engine ends with UNAVAILABLE; pending utility calls fail."""
        lost = engine.closed()
        for listener in self.report_listeners:  # its cache and load are unknown until its next snapshot
            listener(engine.address, engine.load.block_size, SchedulerStats(), KVCacheEvents(cleared=True))
        error = EngineUnavailable(f"engine at {engine.address} disconnected ({reason}); retry the request")
        self._fail_lost(engine.address, lost, engine.pending, error, f"engine at {engine.address} disconnected")
        self._retire_if_idle(engine)
        self._on_change()

    def _on_change(self) -> None:
        if self.is_connected:
            self._connected.set()
        else:
            self._connected.clear()
        self._notify()


def _describe(state: EngineState) -> str:
    if state.admitting:
        return "admitting requests"
    paused = f"paused ({state.pause_mode}): new requests wait for Resume" if state.paused else ""
    asleep = "asleep: new requests are refused until WakeUp" if state.asleep else ""
    return "; ".join(part for part in (paused, asleep) if part)


async def _stream_inputs(queue: asyncio.Queue):
    """The Connect request stream: whatever is put on the queue, until None."""
    while (message := await queue.get()) is not None:
        yield message
