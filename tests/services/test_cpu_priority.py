"""CPU priorities for the threads beside an engine's OpenMP team (services/cpu_priority.py), and who sets them.

Linux-only policies (SCHED_IDLE, nice); a thread's own settings are checked from that thread, so
pytest's process is left as it was (the whole-process case runs in a child process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from clients import local_stack
from services.cpu_priority import set_cpu_priority
from services.frontend.__main__ import parse_args as frontend_args

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setscheduler"), reason="Linux scheduling policies")


def _in_thread(fn):
    result: dict = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if "error" in result:
        raise result["error"]
    return result["value"]


def test_idle_covers_the_thread_and_the_threads_it_starts_not_the_others():
    def body():
        assert set_cpu_priority("idle", whole_process=False)
        child = _in_thread(lambda: os.sched_getscheduler(0))
        return os.sched_getscheduler(0), child

    own, child = _in_thread(body)
    assert own == child == os.SCHED_IDLE
    assert os.sched_getscheduler(0) != os.SCHED_IDLE  # pytest's thread is untouched


def test_low_is_nice_19_and_unknown_priorities_are_refused():
    def body():
        set_cpu_priority("low", whole_process=False)
        return os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    assert _in_thread(body) == (os.SCHED_OTHER, 19)
    with pytest.raises(ValueError, match="choose one of normal, low, idle"):
        set_cpu_priority("realtime")


def test_whole_process_covers_threads_already_running():
    code = """
import os, threading, time
from services.cpu_priority import set_cpu_priority
stop = threading.Event()
worker = threading.Thread(target=stop.wait)
worker.start()
set_cpu_priority("idle")
policies = {os.sched_getscheduler(int(t)) for t in os.listdir("/proc/self/task")}
stop.set()
print(sorted(policies))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == str([os.SCHED_IDLE])


def test_the_frontend_flag_and_tandem_serve_lowers_it(monkeypatch):
    assert frontend_args([]).cpu_priority == "normal"  # alone on its machine
    assert frontend_args(["--cpu-priority", "idle"]).cpu_priority == "idle"
    with pytest.raises(SystemExit):
        frontend_args(["--cpu-priority", "high"])

    spawned: list[list[str]] = []
    monkeypatch.setattr(local_stack.SupervisedProcess, "spawn", lambda self: spawned.append(self.argv))
    monkeypatch.setattr(local_stack, "wait_until_serving", lambda *args: None)
    local_stack.LocalStack(frontend_port=1, engine_port=2, frontend_args=["--log-level", "WARNING"]).start()
    engine, frontend = spawned
    assert "--cpu-priority" not in engine  # the engine sets its gRPC server process's (--io-cpu-priority)
    assert frontend[frontend.index("--cpu-priority") + 1] == "low"
