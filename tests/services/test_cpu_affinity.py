"""--step-cpu: which CPU the engine steps on and where its I/O goes (services/cpu_affinity.py)."""

from __future__ import annotations

import argparse
import os
import threading

import pytest

from services import cpu_affinity
from services.cpu_affinity import (
    choose_step_cpu,
    cpus_besides,
    current_cpu,
    format_cpus,
    parse_cpus,
    pinned,
    step_cpu_flag,
)


def test_auto_takes_the_cpu_this_thread_runs_on_and_none_takes_none():
    allowed = os.sched_getaffinity(0)
    assert current_cpu() in allowed
    assert choose_step_cpu("none") is None
    if len(allowed) > 1:
        assert choose_step_cpu("auto") in allowed
        assert choose_step_cpu(str(max(allowed))) == max(allowed)
    else:
        assert choose_step_cpu("auto") is None  # one CPU: nothing to keep apart


def test_one_cpu_pins_nothing(monkeypatch):
    monkeypatch.setattr(cpu_affinity, "allowed_cpus", lambda: {3})
    assert choose_step_cpu("auto") is None and choose_step_cpu("3") is None
    assert cpus_besides(3) is None


def test_the_io_gets_every_other_cpu(monkeypatch):
    monkeypatch.setattr(cpu_affinity, "allowed_cpus", lambda: {0, 1, 2, 3})
    assert cpus_besides(2) == {0, 1, 3}
    assert cpus_besides(None) is None
    assert parse_cpus(format_cpus({0, 1, 3})) == {0, 1, 3}
    assert format_cpus(None) == "-" and parse_cpus("-") is None


def test_a_bad_step_cpu_is_refused_with_what_to_give():
    with pytest.raises(argparse.ArgumentTypeError, match="auto .* none, or a CPU number; got 'fast'"):
        step_cpu_flag("fast")
    outside = max(os.sched_getaffinity(0)) + 1
    if len(os.sched_getaffinity(0)) > 1:
        with pytest.raises(argparse.ArgumentTypeError, match=f"{outside}: this process may only run on CPUs"):
            step_cpu_flag(str(outside))
    assert step_cpu_flag("auto") == "auto" and step_cpu_flag("none") == "none"


def test_pinned_holds_this_thread_only_and_restores_it():
    allowed = os.sched_getaffinity(0)
    cpu = min(allowed)
    seen: dict[str, set[int]] = {}
    beside = threading.Thread(target=lambda: seen.setdefault("started inside", os.sched_getaffinity(0)))
    with pinned(cpu):
        seen["inside"] = os.sched_getaffinity(0)
        beside.start()
        beside.join()
    assert seen["inside"] == {cpu}
    assert seen["started inside"] == {cpu}  # threads started inside inherit the pin: start them first
    assert os.sched_getaffinity(0) == allowed
    with pinned(None):
        assert os.sched_getaffinity(0) == allowed
