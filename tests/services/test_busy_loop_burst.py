"""The busy loop's burst window: an idle engine's first request waits for the rest of its burst
(a fake engine that records each step's requests; no model, no gRPC)."""

from __future__ import annotations

import threading
import time

import pytest

from engine_core.protocol import EngineCoreOutputs, EngineCoreRequest, SamplingParams
from services.engine.busy_loop import EngineBusyLoop
from services.engine.messages import Add

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


def run_burst(count: int, spacing_s: float, **loop_args) -> list[list[str]]:
    """Submit `count` requests `spacing_s` apart to an idle loop; the engine ids of each step's requests."""
    engine = StepRecorder()
    loop = EngineBusyLoop(engine, **loop_args)
    loop.start()
    try:
        connection = loop.open(lambda item: None)
        for i in range(count):
            if i:
                time.sleep(spacing_s)
            loop.submit(connection, Add(EngineCoreRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1))))
        deadline = time.monotonic() + WAIT_S
        while sum(map(len, engine.steps)) < count and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.stop()
    assert sum(map(len, engine.steps)) == count
    return engine.steps


def test_a_burst_that_wakes_an_idle_loop_starts_in_one_step():
    steps = run_burst(6, 0.02, burst_window_s=WAIT_S, burst_gap_s=0.5)
    assert len(steps) == 1 and len(steps[0]) == 6


def test_without_a_window_the_first_request_steps_at_once():
    steps = run_burst(3, 0.2, burst_window_s=0)
    assert len(steps[0]) == 1


def test_the_window_bounds_the_wait_for_a_steady_trickle():
    steps = run_burst(10, 0.05, burst_window_s=0.1, burst_gap_s=0.5)
    assert 1 <= len(steps[0]) < 10  # the first step went at the window's end, the trickle still coming


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="burst_window_s must be >= 0"):
        EngineBusyLoop(StepRecorder(), burst_window_s=-1)
    with pytest.raises(ValueError, match="burst_gap_s > 0"):
        EngineBusyLoop(StepRecorder(), burst_gap_s=0)
