"""The engine's busy loop: one thread owns the EngineCore and all engine-side state.

Other threads only `submit()` (connection id, item) pairs onto its input queue and
receive outputs through each connection's sink (vLLM v1's EngineCoreProc, with
gRPC streams in place of ZMQ sockets). Each pass: drain every pending input, then
run one step if there is work; block on the queue when there is none.

`run()` steps on the calling thread: `tandem-engine` calls it from the process's main
thread, because torch's OpenMP work started from any other thread runs 1.4-1.65x
slower on these CPUs (services/engine/process.py). `start()` runs the same loop on a
thread of its own, for servers embedded in a test's process.

Request ids are namespaced per connection inside the engine ("{conn}/{id}"), so
two frontends may use the same ids; outputs are routed back by that prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import defaultdict, deque

import torch

from engine_core.engine_core import EngineCore
from engine_core.types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from services.engine.messages import (
    Abort,
    Add,
    Call,
    Close,
    ConnectionOutputs,
    EngineDied,
    Open,
    PauseMode,
    RequestError,
    Utility,
    UtilityMethod,
    UtilityResult,
)
from services.engine.profiler import Profiler
from services.engine.telemetry import EngineTelemetry

logger = logging.getLogger(__name__)

_STOP = object()  # the sentinel that ends the loop
_IDLE_TICK_S = 1.0  # an idle loop still records a heartbeat this often


class EngineBusyLoop:
    def __init__(self, engine: EngineCore, telemetry: EngineTelemetry | None = None) -> None:
        self.engine = engine
        self.telemetry = telemetry  # request spans and step metrics; None: none at all
        self._inputs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders "submit" against "die"
        self._connection_ids = itertools.count(1)
        self._started = False
        self._exited = threading.Event()
        self.thread: threading.Thread | None = None  # the thread that steps the engine, once running
        # ---- owned by the loop thread
        self._sinks: dict[int, object] = {}  # connection id -> sink
        self._owned: dict[int, set[str]] = defaultdict(set)  # connection id -> engine request ids
        self._held: deque[tuple[int, EngineCoreRequest]] = deque()  # adds waiting for resume
        self._admitting = True  # False while paused or draining for a WAIT pause
        self._stepping = True  # False while paused
        self._drain_waiters: list[tuple[int, int]] = []  # (connection, call id) of WAIT pauses
        self._asleep = False
        self._profiler = Profiler(engine.runner.device)
        # ---- read by the health watchdog from any thread
        self.heartbeat = time.monotonic()  # the last completed step or idle wait
        self.busy = False  # working (not blocked on the queue)
        self.error: str | None = None  # set when the loop crashed

    # ---- any thread ---------------------------------------------------------------
    def run(self) -> None:
        """Run the loop on the calling thread until `stop()` (or a crash: see `error`)."""
        self._mark_started()
        self._run()

    def start(self) -> None:
        """Run the loop on a daemon thread of its own."""
        self._mark_started()
        threading.Thread(target=self._run, name="engine-busy-loop", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to end and wait for it (a stuck loop is left behind)."""
        self._inputs.put((0, _STOP))
        if self._started:
            self._exited.wait(timeout)

    def _mark_started(self) -> None:
        if self._started:
            raise RuntimeError("the engine busy loop is already running")
        self._started = True

    def open(self, sink) -> int:
        """Register a connection; `sink(item)` is called from the loop thread and must not block."""
        connection = next(self._connection_ids)
        self.submit(connection, Open(sink))
        return connection

    def close(self, connection: int) -> None:
        self.submit(connection, Close())

    def submit(self, connection: int, item) -> None:
        with self._lock:
            if self.error is None:
                self._inputs.put((connection, item))
                return
        if isinstance(item, Open):
            item.sink(EngineDied(self.error))

    def run_in_loop(self, fn) -> None:
        """Run `fn()` on the loop thread, between steps."""
        self.submit(0, Call(fn))

    @property
    def alive(self) -> bool:
        """Not crashed and not stopped (inputs submitted before it starts wait on its queue)."""
        return self.error is None and not self._exited.is_set()

    def stalled(self, timeout: float) -> bool:
        """Working, but no step or idle wait completed for `timeout` seconds."""
        return self.busy and time.monotonic() - self.heartbeat > timeout

    # ---- the loop -------------------------------------------------------------------
    def _run(self) -> None:
        self.thread = threading.current_thread()
        try:
            while self._process_inputs(block=not self._has_work()):
                if self._has_work():
                    self._route(self._step())
                if self._drain_waiters and not self.engine.has_unfinished_requests():
                    self._finish_drain()  # by finishing or by aborts
                self.heartbeat = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - any crash must fail the connections
            self._die(exc)
        finally:
            with contextlib.suppress(OSError, ValueError):  # a trace that cannot be written is lost
                self._profiler.stop()
            if self.telemetry is not None:
                self.telemetry.close()  # requests still in flight end with the loop
            self._exited.set()

    def _step(self) -> EngineCoreOutputs:
        if self.telemetry is None:
            return self.engine.step()
        started = time.perf_counter()
        step = self.engine.step()
        self.telemetry.record_step(step, time.perf_counter() - started)
        return step

    def _has_work(self) -> bool:
        return self._stepping and self.engine.has_unfinished_requests()

    def _process_inputs(self, block: bool) -> bool:
        """Handle every pending input, first waiting for one if `block`; False on stop."""
        while True:
            try:
                connection, item = self._wait_for_input() if block else self._inputs.get_nowait()
            except queue.Empty:
                return True
            block = False
            if not self._handle(connection, item):
                return False

    def _wait_for_input(self) -> tuple[int, object]:
        """Block on the queue (idle: not busy), at most one idle tick."""
        self.busy = False
        try:
            return self._inputs.get(timeout=_IDLE_TICK_S)
        finally:
            self.heartbeat, self.busy = time.monotonic(), True

    def _handle(self, connection: int, item) -> bool:
        if item is _STOP:
            return False
        if isinstance(item, Add):
            self._add(connection, item.request)
        elif isinstance(item, Abort):
            self._abort(connection, item.request_ids)
        elif isinstance(item, Utility):
            result = self._utility(connection, item)
            if result is not None:
                self._send(connection, ConnectionOutputs(utility_result=result, timestamp=time.time()))
        elif isinstance(item, Open):
            self._sinks[connection] = item.sink
        elif isinstance(item, Close):
            self._close(connection)
        elif isinstance(item, Call):
            item.fn()
        return True

    def _die(self, exc: BaseException) -> None:
        logger.exception("the engine busy loop crashed", exc_info=exc)
        with self._lock:
            self.error = f"engine core crashed: {type(exc).__name__}: {exc}"
            sinks = dict(self._sinks)
            while not self._inputs.empty():
                connection, item = self._inputs.get_nowait()
                if isinstance(item, Open):
                    sinks[connection] = item.sink
        for sink in sinks.values():
            sink(EngineDied(self.error))

    # ---- requests -------------------------------------------------------------------
    def _add(self, connection: int, request: EngineCoreRequest) -> None:
        if connection not in self._sinks:
            return  # the connection closed while this add was queued
        if self._asleep:
            self._refuse(connection, request.request_id, "engine is asleep; call WakeUp")
        elif not self._admitting:
            self._held.append((connection, request))
        else:
            self._admit(connection, request)

    def _admit(self, connection: int, request: EngineCoreRequest) -> None:
        engine_id = f"{connection}/{request.request_id}"
        admitted_ns = time.time_ns()  # the request span starts before the scheduler's QUEUED event
        try:
            self.engine.add_request(dataclasses.replace(request, request_id=engine_id))
        except ValueError as exc:
            self._refuse(connection, request.request_id, str(exc).replace(engine_id, request.request_id))
            return
        self._owned[connection].add(engine_id)
        if self.telemetry is not None:
            self.telemetry.start_request(engine_id, request, admitted_ns)

    def _abort_in_engine(self, engine_ids: list[str]) -> None:
        self.engine.abort_requests(engine_ids)
        if self.telemetry is not None:
            self.telemetry.end_requests(engine_ids)

    def _refuse(self, connection: int, request_id: str, message: str) -> None:
        self._send(connection, ConnectionOutputs(errors=[RequestError(request_id, message)], timestamp=time.time()))

    def _abort(self, connection: int, request_ids: list[str]) -> None:
        """Client aborts: the client knows, so no output is sent (the ids show up as finished)."""
        engine_ids = {f"{connection}/{request_id}" for request_id in request_ids}
        self._abort_in_engine(list(engine_ids))
        self._owned[connection] -= engine_ids
        self._held = deque((c, r) for c, r in self._held if c != connection or r.request_id not in request_ids)

    def _close(self, connection: int) -> None:
        self._abort_in_engine(list(self._owned.pop(connection, ())))
        self._held = deque((c, r) for c, r in self._held if c != connection)
        self._sinks.pop(connection, None)

    def _abort_everything(self) -> None:
        """Server-side aborts (PAUSE ABORT): each request gets an ABORT finish on its connection."""
        now = time.time()
        aborted: dict[int, list[str]] = defaultdict(list)
        for connection, engine_ids in self._owned.items():
            self._abort_in_engine(list(engine_ids))
            aborted[connection] += [engine_id.partition("/")[2] for engine_id in engine_ids]
        for connection, request in self._held:
            aborted[connection].append(request.request_id)
        self._owned.clear()
        self._held.clear()
        for connection, request_ids in aborted.items():
            if not request_ids:
                continue
            outputs = [EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in request_ids]
            self._send(connection, ConnectionOutputs(outputs, request_ids, self.engine.make_stats(), now))

    # ---- outputs --------------------------------------------------------------------
    def _route(self, step: EngineCoreOutputs) -> None:
        """One message per connection that has outputs or finished requests in this step."""
        messages: dict[int, ConnectionOutputs] = {}

        def message_for(engine_id: str) -> tuple[ConnectionOutputs, str]:
            prefix, _, request_id = engine_id.partition("/")
            connection = int(prefix)
            if connection not in messages:
                messages[connection] = ConnectionOutputs(scheduler_stats=step.scheduler_stats, timestamp=step.timestamp)
            return messages[connection], request_id

        for output in step.outputs:
            message, request_id = message_for(output.request_id)
            message.outputs.append(dataclasses.replace(output, request_id=request_id))
        for engine_id in step.finished_request_ids:
            message, request_id = message_for(engine_id)
            message.finished_request_ids.append(request_id)
            self._owned.get(int(engine_id.partition("/")[0]), set()).discard(engine_id)
        for connection, message in messages.items():
            self._send(connection, message)

    def _send(self, connection: int, item) -> None:
        sink = self._sinks.get(connection)
        if sink is not None:
            sink(item)

    # ---- utility calls ----------------------------------------------------------------
    def _utility(self, connection: int, call: Utility) -> UtilityResult | None:
        """Run one utility call; None when its result comes later (a WAIT pause)."""
        method = call.method
        if method is UtilityMethod.PAUSE:
            return self._pause(connection, call)
        if method is UtilityMethod.RESUME:
            self._resume()
        elif method is UtilityMethod.RESET_PREFIX_CACHE:
            if not self.engine.reset_prefix_cache():
                return self._fail(call, "KV blocks are in use by requests in flight; abort or finish them first")
        elif method is UtilityMethod.SLEEP:
            if self.engine.has_unfinished_requests():
                return self._fail(call, f"{self.engine.get_num_unfinished_requests()} requests are in flight; "
                                        "pause with mode ABORT (or let them finish) before Sleep")
            self._sleep()
        elif method is UtilityMethod.WAKE_UP:
            self._wake_up()
        elif method is UtilityMethod.START_PROFILE:
            if self._profiler.running:
                return self._fail(call, "a profile is already running; call StopProfile first")
            if not call.profile_dir:
                return self._fail(call, "profile_dir must name a folder for the trace")
            try:
                self._profiler.start(call.profile_dir)
            except (OSError, ValueError) as exc:  # a folder that cannot be made: the caller's to fix
                return self._fail(call, f"cannot write a profile into {call.profile_dir!r}: {exc}")
        elif method is UtilityMethod.STOP_PROFILE:
            try:
                trace = self._profiler.stop()
            except (OSError, ValueError) as exc:  # e.g. the folder was removed while profiling
                return self._fail(call, f"the profile could not be written: {exc}")
            if trace is None:
                return self._fail(call, "no profile is running; call StartProfile first")
        return UtilityResult(call.call_id, True, stats=self.engine.make_stats())

    def _fail(self, call: Utility, error: str) -> UtilityResult:
        return UtilityResult(call.call_id, False, error, self.engine.make_stats())

    def _pause(self, connection: int, call: Utility) -> UtilityResult | None:
        self._admitting = False
        if call.pause_mode is PauseMode.ABORT:
            self._abort_everything()
            self._stepping = False
        elif call.pause_mode is PauseMode.KEEP:
            self._stepping = False
        else:  # WAIT: keep stepping until running requests finish, then answer
            self._stepping = True
            self._drain_waiters.append((connection, call.call_id))
            return None  # answered by the loop once nothing is in flight
        return UtilityResult(call.call_id, True, stats=self.engine.make_stats())

    def _finish_drain(self) -> None:
        self._stepping = False
        self._answer_drain_waiters(ok=True)

    def _answer_drain_waiters(self, ok: bool, error: str = "") -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for connection, call_id in waiters:
            result = UtilityResult(call_id, ok, error, self.engine.make_stats())
            self._send(connection, ConnectionOutputs(utility_result=result, timestamp=time.time()))

    def _resume(self) -> None:
        self._answer_drain_waiters(ok=False, error="resumed before the running requests finished")
        self._admitting = self._stepping = True
        held, self._held = self._held, deque()
        for connection, request in held:
            self._add(connection, request)

    def _sleep(self) -> None:
        """Free the KV cache (and on CUDA move the weights to CPU) until wake up."""
        if self._asleep:
            return
        self.engine.runner.free_kv_cache()
        if self.engine.runner.device.type == "cuda":
            self.engine.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def _wake_up(self) -> None:
        if not self._asleep:
            return
        runner = self.engine.runner
        if runner.device.type == "cuda":
            self.engine.model.to(runner.device)
        runner.allocate_kv_cache()
        self.engine.reset_prefix_cache()  # the cached blocks' contents are gone
        self._asleep = False
