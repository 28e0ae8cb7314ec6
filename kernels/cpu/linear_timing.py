"""Timing candidates at load on a shared CPU: interleaved rounds, best of rounds, one call each.

Used by kernels/cpu/linear.py to choose linear kernels and the float dtype by measurement. A race
run while a neighbour held the cores (`Race.noisy`: its two halves of rounds disagree, or all
threads ran slower than one) is retaken by `settled_race`, and a plan that stays noisy is used
for the load but not kept (kernels/cpu/linear_plan_cache.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

_HOPELESS = 3.0  # from round 3, a candidate this many times slower than the best stops being timed
_CONTENDED = 1.5  # all threads this many times slower than one: the race was lost to neighbours
# A race whose halves of rounds disagree by more than this on a candidate's best time was disturbed
# (docs/cpu-kernels.md#timings-taken-on-a-busy-machine has the figures behind it)
NOISE_LIMIT = 0.25
RETAKES = 2  # a noisy race is timed again at most this many times ...
BACKOFF_S = 0.05  # ... after a pause of this times the retake's number, for a neighbour's burst to pass

Timer = Callable[[str, int, Callable[[], object]], float]  # (kernel, rows, fn) -> seconds per call
# told of every race as it starts (candidates, rows): kernels/compile_watch.py counts plan timings after ready
race_watchers: list[Callable[[list[str], int], None]] = []


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
    return {name: min(times) for name, times in rounds_of(candidates, rows, timer, min_rounds, max_rounds,
                                                          budget_s).items()}


def rounds_of(candidates: dict[str, Callable[[], object]], rows: int, timer: Timer = wall_timer,
              min_rounds: int = 5, max_rounds: int = 20, budget_s: float = 0.06) -> dict[str, list[float]]:
    """`fastest`'s race, each candidate's seconds per call in every round it ran, in order."""
    for watcher in race_watchers:
        watcher(list(candidates), rows)
    for name, fn in candidates.items():
        timer(name, rows, fn)  # warm-up: first-call allocations, oneDNN primitive creation
    times: dict[str, list[float]] = {name: [] for name in candidates}
    racing = dict(candidates)
    spent, rounds = 0.0, 0
    while rounds < min_rounds or (spent < budget_s and rounds < max_rounds):
        for name, fn in racing.items():
            elapsed = timer(name, rows, fn)
            times[name].append(elapsed)
            spent += elapsed
        rounds += 1
        if rounds >= 3:
            leader = min(min(times[name]) for name in racing)
            racing = {name: fn for name, fn in racing.items() if min(times[name]) <= _HOPELESS * leader}
    return times


def split_half_noise(times: dict[str, list[float]]) -> float:
    """How far the first and second halves of a race's rounds disagree on a candidate's best time,
    the worst over the candidates that ran every round: 0.1 when one half's minimum is 10 % above
    the other's. A minimum is only an answer if the rounds reproduce it; a neighbour's burst shorter
    than a round spoils single calls and leaves both halves' minimums alone (and the race's answer
    with them), one that covers a stretch of the rounds lifts that half's, and the ranking with it.
    0 for a race of fewer than 2 rounds."""
    rounds = max((len(run) for run in times.values()), default=0)
    if rounds < 2:
        return 0.0
    disagreements = []
    for run in times.values():
        if len(run) == rounds:
            first, second = min(run[: rounds // 2]), min(run[rounds // 2:])
            disagreements.append(max(first, second) / max(min(first, second), 1e-12) - 1.0)
    return max(disagreements)


@dataclasses.dataclass(frozen=True)
class Race:
    """One race's answer and how far to trust it.

    timings: seconds per call of each candidate; noise: `split_half_noise` of the rounds that gave
    them; contended: all threads ran over `_CONTENDED` times slower than one, and one-thread times
    ranked the candidates; retakes: noisy races timed again before this one (`settled_race`);
    one_thread_takes: of this take and those retaken, how many were contended."""

    timings: dict[str, float]
    noise: float
    contended: bool
    retakes: int = 0
    one_thread_takes: int = 0

    @property
    def noisy(self) -> bool:
        """Timed while the machine was busy: not to be kept for another load."""
        return self.contended or self.noise > NOISE_LIMIT


def rotating(run: Callable, states: list, x: torch.Tensor) -> Callable[[], object]:
    """One call per timing, each on the next weight of the list: a weight is cold again when its
    turn comes back (as in a real step, which reads every layer once), and one call is short
    enough to fall between a neighbour's bursts, where a whole sweep of layers rarely does (on
    2 oversubscribed OpenMP threads every op of a sweep may wait a time slice:
    docs/cpu-kernels.md#timings-taken-on-a-busy-machine)."""
    turns = itertools.cycle(states)
    return lambda: run(next(turns), x)


@contextmanager
def one_thread() -> Iterator[None]:
    """Load-time preparation (quantizing, packing) on one thread: its many small ops each open an
    OpenMP parallel region, and on a shared, oversubscribed machine a region waits for a
    descheduled partner thread, many times the work's own time (docs/cpu-kernels.md#timings-taken-on-a-busy-machine)."""
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
    race = timed_race(candidates, rows, timer, **rounds)
    return race.timings, race.contended


def timed_race(candidates: dict[str, Callable[[], object]], rows: int, timer: Timer = wall_timer,
               **rounds) -> Race:
    """`fastest_uncontended` as a `Race`, with the noise of its rounds on torch's threads."""
    times = rounds_of(candidates, rows, timer, **rounds)
    timings = {name: min(run) for name, run in times.items()}
    noise = split_half_noise(times)
    if torch.get_num_threads() == 1:
        return Race(timings, noise, contended=False)
    with one_thread():  # a check and a fallback ranking: no time slices to wait for, 3 rounds do
        alone = fastest(candidates, rows, timer, min_rounds=3, max_rounds=3)
    contended = min(timings.values()) > _CONTENDED * min(alone.values())
    return Race(alone if contended else timings, noise, contended, one_thread_takes=int(contended))


def settled_race(candidates: dict[str, Callable[[], object]], rows: int, timer: Timer = wall_timer,
                 retakes: int = RETAKES, **rounds) -> Race:
    """`timed_race`, timed again after a short pause while it is noisy, at most `retakes` times;
    the steadiest take (uncontended first, then the least noise) is the answer, with the number of
    retakes. Its `noisy` still says whether even that take was disturbed."""
    race = timed_race(candidates, rows, timer, **rounds)
    for retake in range(1, retakes + 1):
        if not race.noisy:
            break
        time.sleep(BACKOFF_S * retake)
        again = timed_race(candidates, rows, timer, **rounds)
        steadier = min(race, again, key=lambda r: (r.contended, r.noise))
        race = dataclasses.replace(steadier, retakes=retake,
                                   one_thread_takes=race.one_thread_takes + again.one_thread_takes)
    return race
