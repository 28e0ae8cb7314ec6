"""Keep the engine's stepping thread on a CPU of its own, and its I/O off that CPU (torch-free).

The model steps on the engine process's main thread, which runs every Python part of a step
alone and its share of each OpenMP region. Whatever wakes beside it (the gRPC server process,
or the in-process transport's I/O thread) is placed by the kernel on the waker's CPU, preempts
the stepping thread there and stalls the whole step, while the CPU of the OpenMP worker (idle
between regions) waits. `--step-cpu auto` pins the stepping thread to the CPU it runs on and
keeps the I/O on the others, where it fills the workers' idle moments instead: gRPC's share of
in-process throughput rises (docs/cpu-tuning.md#two-processes-per-engine; scripts/bench_engine.py).

Only the stepping thread is pinned: the OpenMP workers, made before it is
(the model's load runs parallel regions), keep the process's CPUs, and so do threads started
before it. Several engines on one machine each want all their CPUs (OpenMP): give each its own
set (`taskset`, `docker run --cpuset-cpus`), which `auto` chooses within.
"""

from __future__ import annotations

import argparse
import logging
import os
from contextlib import contextmanager
from typing import Iterator

from services.cpu_priority import thread_ids

logger = logging.getLogger(__name__)

STEP_CPU_CHOICES = "auto (the CPU the engine's main thread runs on), none, or a CPU number"


def allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on; None where the OS cannot say (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return set(os.sched_getaffinity(0))


def current_cpu() -> int | None:
    """The CPU the calling thread runs on now (field 39 of /proc/thread-self/stat); None if unknown."""
    try:
        with open("/proc/thread-self/stat") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[36])  # fields after "(comm)" start at field 3


def choose_step_cpu(step_cpu: str) -> int | None:
    """The CPU for the stepping thread under `step_cpu` (auto | none | N), or None to leave it
    unpinned: `none`, one CPU only (nothing to keep apart), or an OS without affinity."""
    allowed = allowed_cpus()
    if step_cpu == "none" or allowed is None or len(allowed) < 2:
        return None
    if step_cpu == "auto":
        cpu = current_cpu()
        return cpu if cpu in allowed else min(allowed)
    try:
        cpu = int(step_cpu)
    except ValueError:
        raise ValueError(f"--step-cpu must be {STEP_CPU_CHOICES}; got {step_cpu!r}") from None
    if cpu not in allowed:
        raise ValueError(f"--step-cpu {cpu}: this process may only run on CPUs {sorted(allowed)}")
    return cpu


def step_cpu_flag(word: str) -> str:
    """argparse type of --step-cpu: checks the word (and that a CPU number is one of this process's)."""
    try:
        choose_step_cpu(word)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--step-cpu ")) from None
    return word


@contextmanager
def pinned(cpu: int | None) -> Iterator[None]:
    """Run the calling thread (only) on `cpu` inside the block, then on its CPUs before; threads it
    starts inside inherit the pin. None: no change."""
    if cpu is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    logger.info("the engine steps on CPU %d; its I/O runs on the others", cpu)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def format_cpus(cpus: set[int] | None) -> str:
    """`cpus` as a command-line word ("1,2", "-" for None); `parse_cpus` reads it back."""
    return ",".join(map(str, sorted(cpus))) if cpus else "-"


def parse_cpus(word: str) -> set[int] | None:
    return None if word == "-" else {int(cpu) for cpu in word.split(",")}


def cpus_besides(cpu: int | None) -> set[int] | None:
    """This process's CPUs without `cpu` (for the I/O beside a stepping thread pinned there); None
    when there is nothing to keep apart."""
    allowed = allowed_cpus()
    if cpu is None or allowed is None or not allowed - {cpu}:
        return None
    return allowed - {cpu}


def run_on(cpus: set[int] | None, whole_process: bool = True) -> None:
    """Run this process's threads (or only the calling one) on `cpus`; None leaves them be. Threads
    started afterwards inherit it from their starter."""
    if cpus is None:
        return
    for thread in thread_ids() if whole_process else [0]:
        try:
            os.sched_setaffinity(thread, cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
