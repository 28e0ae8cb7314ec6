"""Timing candidates at load on a shared CPU: interleaved rounds, best of rounds, one call each.

Used by kernels/cpu_linear.py to choose linear kernels and the float dtype by measurement.
"""

from __future__ import annotations

import itertools
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

_HOPELESS = 3.0  # from round 3, a candidate this many times slower than the best stops being timed
_CONTENDED = 1.5  # all threads this many times slower than one: the race was lost to neighbours

Timer = Callable[[str, int, Callable[[], object]], float]  # (kernel, rows, fn) -> seconds per call


def wall_timer(kernel: str, rows: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def fastest(candidates: dict[str, Callable[[], object]], rows: int, timer: Timer = wall_timer,
            min_rounds: int = 5, max_rounds: int = 20, budget_s: float = 0.06) -> dict[str, float]:
    """Seconds per call of each candidate: the minimum over rounds that take every candidate in
    turn, so a burst from a neighbour on a shared machine hits them all alike. From the third
    round on, a candidate over `_HOPELESS` times the best so far leaves the race with its time
    (int8 weight-only at 128 rows, say, took half the load's timing before)."""
    for name, fn in candidates.items():
        timer(name, rows, fn)  # warm-up: first-call allocations, oneDNN primitive creation
    best = dict.fromkeys(candidates, float("inf"))
    racing = dict(candidates)
    spent, rounds = 0.0, 0
    while rounds < min_rounds or (spent < budget_s and rounds < max_rounds):
        for name, fn in racing.items():
            elapsed = timer(name, rows, fn)
            best[name], spent = min(best[name], elapsed), spent + elapsed
        rounds += 1
        if rounds >= 3:
            leader = min(best[name] for name in racing)
            racing = {name: fn for name, fn in racing.items() if best[name] <= _HOPELESS * leader}
    return best


def rotating(run: Callable, states: list, x: torch.Tensor) -> Callable[[], object]:
    """One call per timing, each on the next weight of the list: a weight is cold again when its
    turn comes back (as in a real step, which reads every layer once), and one call is short
    enough to fall between a neighbour's bursts, where a whole sweep of layers rarely does (on
    2 oversubscribed OpenMP threads every op of a sweep may wait a time slice, ~8 ms here)."""
    turns = itertools.cycle(states)
    return lambda: run(next(turns), x)


@contextmanager
def one_thread() -> Iterator[None]:
    """Load-time preparation (quantizing, packing) on one thread: its many small ops each open an
    OpenMP parallel region, and on a shared, oversubscribed machine a region waits for a
    descheduled partner thread (int4_is_exact: 0.85 ms on 1 thread, 26-34 ms on 2, here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fastest_uncontended(candidates: dict[str, Callable[[], object]], rows: int, timer: Timer = wall_timer,
                        **rounds) -> tuple[dict[str, float], bool]:
    """`fastest` on torch's threads, and again on one thread; the one-thread times stand in when
    the best candidate ran over `_CONTENDED` times slower on all threads than on one, which no
    kernel does on a machine of its own: there the OpenMP threads waited for time slices (a
    neighbour holds the cores) and the race measured the scheduler, not the kernels. Returns
    (seconds per call of each candidate, whether the one-thread times were used)."""
    timings = fastest(candidates, rows, timer, **rounds)
    if torch.get_num_threads() == 1:
        return timings, False
    with one_thread():  # a check and a fallback ranking: no time slices to wait for, 3 rounds do
        alone = fastest(candidates, rows, timer, min_rounds=3, max_rounds=3)
    contended = min(timings.values()) > _CONTENDED * min(alone.values())
    return (alone if contended else timings), contended
