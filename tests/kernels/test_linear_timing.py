"""Load-time timing helpers (kernels/linear_timing.py)."""

from __future__ import annotations

import torch

from kernels.linear_timing import fastest, fastest_uncontended, one_thread, rotating


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
