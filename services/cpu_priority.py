"""CPU priority for the threads that share cores with an engine's OpenMP team (Linux scheduling policies).

An engine core on CPU runs every parallel region of its step as an OpenMP team, one thread per
core, that meets at a barrier when the region ends: whenever another thread takes one of those
cores, even briefly, the whole team waits for it. A frontend beside the engine (`tandem serve`,
`docker compose` on one host) wakes several threads for each generated token (gRPC's event
engine, its completion-queue poller, the asyncio loop), and every wake-up lands on a core that an
OpenMP thread holds. At `low` (nice 19) those threads mostly wait for a core the engine leaves free
between its parallel regions and steps; at `idle` (SCHED_IDLE) they always do, so each output
waits about one decode step. `low` gains throughput for a few milliseconds of TTFT
(docs/cpu-tuning.md#cpu-priorities).

Threads inherit the policy of the thread that creates them, so `set_cpu_priority` covers the
process's threads now and those started later (or only the calling thread, `whole_process=False`).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

CPU_PRIORITIES = ("normal", "low", "idle")  # low: nice 19; idle: SCHED_IDLE (only what nothing else wants)


def set_cpu_priority(priority: str, whole_process: bool = True) -> bool:
    """Run this process's threads (or only the calling one) at `priority`; False where the OS has no
    such policy (not Linux) or refused it (going back up from `idle` may need CAP_SYS_NICE)."""
    if priority not in CPU_PRIORITIES:
        raise ValueError(f"unknown CPU priority {priority!r}: choose one of {', '.join(CPU_PRIORITIES)}")
    if not hasattr(os, "sched_setscheduler"):
        logger.warning("CPU priority %r is not available on this OS; running at the default", priority)
        return False
    threads = thread_ids() if whole_process else [0]
    try:
        for thread in threads:
            try:
                _apply(thread, priority)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
    except PermissionError as exc:
        logger.warning("could not set CPU priority %r: %s", priority, exc)
        return False
    return True


def lower_cpu_priority(priority: str, whole_process: bool = True) -> None:
    """What the --cpu-priority flags do: `low` and `idle` lower the priority; `normal` keeps the one
    the process was started with (under `nice` or a container's setting, it stays)."""
    if priority != "normal":
        set_cpu_priority(priority, whole_process)


def thread_ids() -> list[int]:
    """This process's thread ids (the calling thread's 0 where /proc is missing)."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:  # no /proc: the calling thread only
        return [0]


def _apply(thread: int, priority: str) -> None:
    if priority == "idle":
        os.sched_setscheduler(thread, os.SCHED_IDLE, os.sched_param(0))
        return
    os.sched_setscheduler(thread, os.SCHED_OTHER, os.sched_param(0))
    os.setpriority(os.PRIO_PROCESS, thread, 19 if priority == "low" else 0)
