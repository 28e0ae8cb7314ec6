"""The busy loop's burst window: an idle engine's first request waits for the rest of its burst
(a fake engine that records each step's requests; no model, no gRPC)."""

from __future__ import annotations

import threading
import time

import pytest

from engine_core.protocol import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from services.engine.busy_loop import EngineBusyLoop
from services.engine.busy_loop_items import Add

WAIT_S = 30.0


class StepRecorder:
    """Stands in for EngineCore: each step takes every added request and finishes it."""

    asleep = False
    records_kv_events = False

    def __init__(self) -> None:
        self.waiting: list[str] = []
        self.steps: list[list[str]] = []
        self.stepped = threading.Event()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.waiting.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def step(self) -> EngineCoreOutputs:
        self.steps.append(self.waiting)
        self.waiting = []
        self.stepped.set()
        return EngineCoreOutputs(outputs=[], finished_request_ids=set(), timestamp=time.time())

    def stop_profile(self) -> None:
        pass

    def list_loras(self) -> list:
        return []


def add(loop: EngineBusyLoop, connection: int, i: int) -> None:
    loop.submit(connection, Add(EngineCoreRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1))))


def steps_of_queued_burst(count: int, **loop_args) -> list[list[str]]:
    """Queue `count` requests, then start an idle loop on them; each step's requests (engine ids). The
    whole burst is queued when the loop takes its first request, so no timing decides what it finds."""
    engine = StepRecorder()
    loop = EngineBusyLoop(engine, **loop_args)
    connection = loop.open(lambda item: None)
    for i in range(count):
        add(loop, connection, i)
    loop.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while sum(map(len, engine.steps)) < count:
            assert time.monotonic() < deadline, engine.steps
            engine.stepped.wait(0.01)
    finally:
        loop.stop()
    return engine.steps


def test_a_burst_that_wakes_an_idle_loop_starts_in_one_step():
    assert list(map(len, steps_of_queued_burst(6, burst_window_s=WAIT_S, burst_gap_s=0.05))) == [6]


def test_without_a_window_the_first_request_steps_at_once():
    assert len(steps_of_queued_burst(3, burst_window_s=0)[0]) == 1


def test_the_window_bounds_the_wait_for_a_steady_trickle():
    """Requests keep coming, each well within the gap: only the window can end the wait, and it does."""
    engine = StepRecorder()
    loop = EngineBusyLoop(engine, burst_window_s=0.1, burst_gap_s=WAIT_S)
    loop.start()
    try:
        connection = loop.open(lambda item: None)
        sent = 0
        while not engine.stepped.is_set():
            assert sent < 10_000, "the loop never stepped while the trickle went on"
            add(loop, connection, sent)
            sent += 1
            engine.stepped.wait(0.01)
    finally:
        loop.stop()
    assert 1 <= len(engine.steps[0]) <= sent


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="burst_window_s must be >= 0"):
        EngineBusyLoop(StepRecorder(), burst_window_s=-1)
    with pytest.raises(ValueError, match="burst_gap_s > 0"):
        EngineBusyLoop(StepRecorder(), burst_gap_s=0)
