"""The engine's busy loop: one thread owns the EngineCore and all engine-side state.

Other threads only `submit()` (connection id, item) pairs onto its input queue and
receive outputs through each connection's sink (vLLM v1's EngineCoreProc, with
gRPC streams in place of ZMQ sockets). Each pass: drain every pending input, then
run one step if there is work; block on the queue when there is none. A request that
wakes an idle loop waits a moment for the rest of its burst (`burst_window_s`).

`run()` steps on the calling thread: `tandem-engine` calls it from the process's main
thread, because torch's OpenMP work started from any other thread runs slower
(docs/cpu-tuning.md#two-processes-per-engine). `start()` runs the same loop on a thread of its
own, for servers embedded in a test's process.

Its parts: `ConnectionRouter` (routing.py) maps engine ids to (connection, request id), so two
frontends may use the same ids; `PauseState` (pause.py) says whether it admits and steps; `EngineControl`
(control.py) runs the control calls (pause, sleep, LoRA, profile, ...) through its one table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from engine_core.lora.errors import LoraDisabledError, UnknownLoraError
from engine_core.protocol import EngineCoreOutputs, EngineCoreRequest, EngineState, RequestErrorKind, UtilityCall
from services.engine.busy_loop_items import Abort, Add, Call, Close, EngineDied, Open
from services.engine.control import EngineControl
from services.engine.pause import PauseState
from services.engine.routing import ConnectionRouter
from services.engine.telemetry import EngineTelemetry

if TYPE_CHECKING:  # torch-free to import: tandem-engine's flags read its defaults before torch loads
    from engine_core.engine_core import EngineCore

logger = logging.getLogger(__name__)

_STOP = object()  # the sentinel that ends the loop
_IDLE_TICK_S = 1.0  # an idle loop still records a heartbeat this often
# An idle engine's first request may open a burst: it waits for the rest, each arriving within this
# gap of the last (a client's burst arrives well within it), for at most the burst window. Stepping at
# once on the first instead ran a 128-token step alone, and a frontend at low CPU priority could not
# forward the others until it ended, a step or more of TTFT for each (docs/cpu-tuning.md#bursts).
BURST_GAP_S = 0.002
DEFAULT_BURST_WINDOW_S = 0.02


class EngineBusyLoop:
    def __init__(self, engine: EngineCore, telemetry: EngineTelemetry | None = None,
                 burst_window_s: float = DEFAULT_BURST_WINDOW_S, burst_gap_s: float = BURST_GAP_S) -> None:
        """burst_window_s: the longest an idle engine waits for the rest of a burst after its first
        request (0: it steps at once); burst_gap_s: the most time between two requests of a burst."""
        if burst_window_s < 0 or burst_gap_s <= 0:
            raise ValueError(f"burst_window_s must be >= 0 and burst_gap_s > 0, got {burst_window_s}, {burst_gap_s}")
        self.engine = engine
        self.telemetry = telemetry  # request spans and step metrics; None: none at all
        self.burst_window_s, self.burst_gap_s = burst_window_s, burst_gap_s
        self._inputs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # orders "submit" against "die"
        self._connection_ids = itertools.count(1)
        self._started = False
        self._exited = threading.Event()
        self.thread: threading.Thread | None = None  # the thread that steps the engine, once running
        # ---- owned by the loop thread
        self._router = ConnectionRouter()
        self._pause = PauseState()
        self._control = EngineControl(engine, self._router, self._pause, admit=self._add, abort=self._abort_in_engine)
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
            self._control.publish_state()  # the adapters loaded at start (--lora), before any connection opens
            while self._process_inputs(block=not self._has_work()):
                if self._has_work():
                    self._router.route(self._step())
                if self._pause.draining and not self.engine.has_unfinished_requests():
                    self._control.finish_drain()
                self.heartbeat = time.monotonic()
        except BaseException as exc:  # noqa: BLE001 - any crash must fail the connections
            self._die(exc)
        finally:
            with contextlib.suppress(ValueError):  # none running, or a trace that cannot be written: lost
                self.engine.stop_profile()
            if self.telemetry is not None:
                self.telemetry.close()  # requests still in flight end with the loop
            self._exited.set()

    def _step(self) -> EngineCoreOutputs:
        if self.telemetry is None:
            return self.engine.step()
        started = time.perf_counter()
        step = self.engine.step()
        self.telemetry.record_step(step, time.perf_counter() - started, self.engine.last_mask_timing)
        return step

    def _has_work(self) -> bool:
        return self._pause.stepping and self.engine.has_unfinished_requests()

    def _process_inputs(self, block: bool) -> bool:
        """Handle every pending input, first waiting for one if `block` (idle); False on stop."""
        idle = block
        while True:
            try:
                connection, item = self._wait_for_input() if block else self._inputs.get_nowait()
            except queue.Empty:
                return True
            block = False
            if not self._handle(connection, item):
                return False
            if idle and isinstance(item, Add):
                return self._gather_burst()

    def _gather_burst(self) -> bool:
        """After an idle engine's first request: handle inputs until none comes for the burst gap or
        the burst window ends, so a burst starts in one step; False on stop."""
        deadline = time.monotonic() + self.burst_window_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                connection, item = self._inputs.get(timeout=min(self.burst_gap_s, left))
            except queue.Empty:
                return True
            if not self._handle(connection, item):
                return False
        return True

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
        elif isinstance(item, UtilityCall):
            self._control.run(connection, item)
        elif isinstance(item, Open):
            self._router.open(connection, item.sink)
            self._greet(connection)
        elif isinstance(item, Close):
            self._close(connection)
        elif isinstance(item, Call):
            item.fn()
        return True

    def _greet(self, connection: int) -> None:
        """A new connection's first message: the prefix cache as it is (its routing starts there) and, when the
        engine is paused or asleep, its state (a frontend that is told nothing takes the engine to admit)."""
        state = self._control.published_state if self._control.published_state != EngineState() else None
        if self.engine.records_kv_events:
            self._router.send_snapshot(connection, self.engine.kv_cache_snapshot(), self.engine.make_stats(), state)
        elif state is not None:
            self._router.send_state(connection, state)

    def _die(self, exc: BaseException) -> None:
        logger.exception("the engine busy loop crashed", exc_info=exc)
        with self._lock:
            self.error = f"engine core crashed: {type(exc).__name__}: {exc}"
            sinks = dict(self._router.sinks)
            while not self._inputs.empty():
                connection, item = self._inputs.get_nowait()
                if isinstance(item, Open):
                    sinks[connection] = item.sink
        for sink in sinks.values():
            sink(EngineDied(self.error))

    # ---- requests -------------------------------------------------------------------
    def _add(self, connection: int, request: EngineCoreRequest) -> None:
        if not self._router.is_open(connection):
            return  # the connection closed while this add was queued
        if self.engine.asleep:
            self._router.refuse(connection, request.request_id, "the engine is asleep until WakeUp",
                                RequestErrorKind.ASLEEP)
        elif not self._pause.admitting:
            self._pause.hold(connection, request)
        else:
            self._admit(connection, request)

    def _admit(self, connection: int, request: EngineCoreRequest) -> None:
        admitted_ns = time.time_ns()  # the request span starts before the scheduler's QUEUED event
        try:
            engine_id = self._router.assign(connection, request.request_id)  # refuses a duplicate id
            try:
                self.engine.add_request(dataclasses.replace(request, request_id=engine_id))
            except ValueError:
                self._router.forget(engine_id)
                raise
        except (UnknownLoraError, LoraDisabledError) as exc:  # an adapter this engine does not have
            self._router.refuse(connection, request.request_id, str(exc), RequestErrorKind.NOT_FOUND)
            return
        except ValueError as exc:
            self._router.refuse(connection, request.request_id, str(exc))
            return
        if self.telemetry is not None:
            self.telemetry.start_request(engine_id, request, admitted_ns)

    def _abort_in_engine(self, engine_ids: list[str]) -> None:
        self.engine.abort_requests(engine_ids)
        if self.telemetry is not None:
            self.telemetry.end_requests(engine_ids)

    def _abort(self, connection: int, request_ids: list[str]) -> None:
        """Client aborts: the client knows, so no output is sent (the ids show up as finished)."""
        self._abort_in_engine(self._router.release(connection, request_ids))
        self._pause.drop_held(connection, request_ids)

    def _close(self, connection: int) -> None:
        self._abort_in_engine(self._router.close(connection))
        self._pause.drop_held(connection)
