"""Load-time timing helpers (kernels/cpu/linear_timing.py): rounds, the one-thread check, the noise of a
race and its retakes, and a race timed while competing processes take the core."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
import torch

from kernels.cpu import linear_timing
from kernels.cpu.linear_timing import (
    NOISE_LIMIT,
    RETAKES,
    Race,
    fastest,
    fastest_uncontended,
    one_thread,
    rotating,
    settled_race,
    split_half_noise,
)


@pytest.fixture(autouse=True)
def no_backoff(private_cache, monkeypatch):  # private_cache: nothing here reads or writes a cache, in case
    monkeypatch.setattr(linear_timing, "BACKOFF_S", 0.0)


def test_rotating_calls_take_the_weights_in_turn():
    seen = []
    call = rotating(lambda state, x: seen.append((state, x)), ["w0", "w1", "w2"], "x")
    for _ in range(5):
        call()
    assert seen == [("w0", "x"), ("w1", "x"), ("w2", "x"), ("w0", "x"), ("w1", "x")]


def test_one_thread_restores_the_thread_count_even_on_error():
    before = torch.get_num_threads()
    try:
        with one_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert torch.get_num_threads() == before


def test_one_thread_times_stand_in_when_all_threads_were_slower():
    def costs(on_all_threads: dict, on_one: dict):
        return lambda name, rows, fn: (on_one if torch.get_num_threads() == 1 else on_all_threads)[name]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        candidates = {"a": lambda: None, "b": lambda: None}
        quiet = fastest_uncontended(candidates, 1, costs({"a": 1.0, "b": 2.0}, {"a": 1.9, "b": 1.2}))
        # threads waiting for time slices: every op costs a slice whatever the kernel
        busy = fastest_uncontended(candidates, 1, costs({"a": 8.0, "b": 8.0}, {"a": 1.9, "b": 1.2}))
    finally:
        torch.set_num_threads(threads)
    assert quiet == ({"a": 1.0, "b": 2.0}, False)
    assert busy == ({"a": 1.9, "b": 1.2}, True)


def test_a_hopeless_candidate_leaves_the_race_after_three_rounds():
    calls = {"slow": 0, "fast": 0}
    def timer(kernel, rows, fn):
        calls[kernel] += 1
        return 10.0 if kernel == "slow" else 1.0
    best = fastest({"slow": lambda: None, "fast": lambda: None}, rows=1, timer=timer, min_rounds=6, budget_s=0.0)
    assert best == {"slow": 10.0, "fast": 1.0}
    assert calls == {"slow": 4, "fast": 7}  # warm-up + 3 rounds, against warm-up + 6 rounds


def test_split_half_noise_is_how_far_the_halves_best_calls_disagree():
    assert split_half_noise({"a": [1.0, 1.1, 1.0, 1.2], "b": [2.0, 2.0, 2.1, 2.0]}) == pytest.approx(0.0)
    # a neighbour from the middle on: the second half's best call is 1.5x the first's
    assert split_half_noise({"a": [1.0, 1.0, 1.5, 1.6], "b": [2.0, 2.0, 2.1, 2.0]}) == pytest.approx(0.5)
    assert split_half_noise({"a": [1.6, 1.5, 1.0, 1.0]}) == pytest.approx(0.5)  # ... or one that left
    # bursts shorter than a round spoil single calls: each half still has its best one
    assert split_half_noise({"a": [9.0, 1.0, 1.0, 9.0], "b": [2.0, 7.0, 7.0, 2.0]}) == pytest.approx(0.0)


def test_split_half_noise_looks_only_at_candidates_that_ran_every_round():
    assert split_half_noise({"fast": [1.0, 1.0, 1.0, 1.0], "hopeless": [9.0, 4.0, 30.0]}) == 0.0
    assert split_half_noise({"a": [1.0]}) == 0.0 and split_half_noise({}) == 0.0


def noisy_then_quiet(noisy_takes: int):
    """A clock whose first `noisy_takes` races (2 candidates, 4 rounds, one thread) have a second half
    twice as slow as the first; later ones are steady."""
    calls = {"n": 0}
    per_take = 2 * (1 + 4)  # warm-up and rounds, for each of the 2 candidates

    def clock(name, rows, fn):
        take, call = divmod(calls["n"], per_take)
        calls["n"] += 1
        second_half = call >= 2 + 2 * 2  # warm-ups, then 2 of the 4 rounds
        return 2.0 if take < noisy_takes and second_half else 1.0
    return clock


@contextmanager
def torch_threads(count: int):
    threads = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_a_quiet_race_is_taken_once():
    with torch_threads(1):
        race = settled_race({"a": lambda: None, "b": lambda: None}, 1, noisy_then_quiet(0), min_rounds=4, max_rounds=4)
    assert race == Race({"a": 1.0, "b": 1.0}, noise=0.0, contended=False, retakes=0)


def test_a_noisy_race_is_retaken_until_quiet():
    with torch_threads(1):
        race = settled_race({"a": lambda: None, "b": lambda: None}, 1, noisy_then_quiet(1), min_rounds=4, max_rounds=4)
    assert not race.noisy and race.retakes == 1 and race.noise == 0.0


def test_a_race_that_stays_noisy_is_retaken_a_bounded_number_of_times():
    clock = noisy_then_quiet(99)
    with torch_threads(1):
        race = settled_race({"a": lambda: None, "b": lambda: None}, 1, clock, min_rounds=4, max_rounds=4)
    assert race.noisy and race.retakes == RETAKES and race.noise == pytest.approx(1.0)
    with torch_threads(1):
        once = settled_race({"a": lambda: None, "b": lambda: None}, 1, clock, retakes=0, min_rounds=4, max_rounds=4)
    assert once.noisy and once.retakes == 0


def test_contended_takes_are_noisy_and_counted():
    def oversubscribed(name, rows, fn):
        return 1.0 if torch.get_num_threads() == 1 else 4.0
    with torch_threads(2):
        race = settled_race({"a": lambda: None}, 1, oversubscribed, min_rounds=4, max_rounds=4)
    assert race.contended and race.noisy and race.one_thread_takes == 1 + RETAKES


# ---- a race timed while competing processes take the core ----

SPIN_S = 0.02  # CPU seconds of each timed call: several scheduler time slices, on any machine
ROUNDS = 6
NEIGHBOURS = 3  # processes spinning on the race's core in the second half of each take


def spin(cpu_seconds: float):
    """A candidate that runs for `cpu_seconds` of this thread's CPU time: alone on its core a call
    lasts about that long whatever the CPU's speed, and beside k spinning processes about k + 1
    times as long (the scheduler's fair share)."""
    def run():
        end = time.thread_time() + cpu_seconds
        while time.thread_time() < end:
            pass
    return run


class NeighboursFromHalfway:
    """A Timer: the wall time of each call, with the competing processes stopped (SIGSTOP) for the
    warm-up and the first half of each take's rounds and running (SIGCONT) for the second half: a
    neighbour's build that starts in the middle of the measurement, in every take."""

    def __init__(self, pids: list[int], rounds: int):
        self.pids, self.rounds, self.calls, self.busy_calls = pids, rounds, {}, 0

    def __call__(self, name, rows, fn):
        call = self.calls.get(name, 0) % (1 + self.rounds)  # 0: the take's warm-up, then its rounds
        self.calls[name] = self.calls.get(name, 0) + 1
        busy = call > self.rounds // 2
        for pid in self.pids:
            os.kill(pid, signal.SIGCONT if busy else signal.SIGSTOP)
        self.busy_calls += busy
        return linear_timing.wall_timer(name, rows, fn)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="pins processes to a core (Linux)")
def test_a_race_timed_while_competing_processes_take_its_core_is_noticed_and_retaken():
    """Issue 49: a timing taken on a busy machine is retaken, and not kept while it stays noisy. The
    race and its competitors share one core (both pinned), so the competitors take that core's time
    on a 2-core and a 64-core machine alike, and each timed call spins for a fixed CPU time, so what
    the detector sees is the scheduler's share (about 1 / (1 + NEIGHBOURS) in the busy half) and not
    the CPU's speed. torch runs on one thread meanwhile: no one-thread check, and no torch thread
    is created inside the pinned stretch."""
    core = min(os.sched_getaffinity(0))
    neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(NEIGHBOURS)]
    mask = os.sched_getaffinity(0)
    try:
        for neighbour in neighbours:
            os.sched_setaffinity(neighbour.pid, {core})
            os.kill(neighbour.pid, signal.SIGSTOP)
        clock = NeighboursFromHalfway([n.pid for n in neighbours], ROUNDS)
        with torch_threads(1):
            os.sched_setaffinity(0, {core})  # this thread only
            try:
                race = settled_race({"a": spin(SPIN_S), "b": spin(SPIN_S)}, 1, clock,
                                    min_rounds=ROUNDS, max_rounds=ROUNDS)
            finally:
                os.sched_setaffinity(0, mask)
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    assert clock.busy_calls == (1 + RETAKES) * 2 * (ROUNDS - ROUNDS // 2)  # every take had its busy half
    assert race.noisy and race.retakes == RETAKES  # noticed in every take, so retaken and not to be kept
    assert race.noise > NOISE_LIMIT
