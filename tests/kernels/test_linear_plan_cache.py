"""Load-time linear plans and the dtype=auto answer are measured once per machine and read back
(kernels/cpu/linear_plan_cache.py); TANDEM_REMEASURE, another machine, changed kernel code or a kernel
no longer allowed measure again. Only quiet races are kept, with when and how noisy they were; an
entry in the older format is timed again.

Every test here times with a steady stand-in for the wall clock (`steady_clock`), which the loads
take for the real one (so they read and write the cache): whether a race is kept must not depend on
how busy the machine running the suite is."""

from __future__ import annotations

import json
import logging
from datetime import datetime

import pytest
import torch
from torch import nn

from kernels.cpu import linear as cpu_linear
from kernels.cpu import linear_plan_cache, linear_timing
from kernels.cpu import plan as float_dtype
from kernels.cpu.linear import CpuLinear, use_measured_linears


@pytest.fixture(autouse=True)
def empty_cache(private_cache):
    return private_cache


def install_clock(monkeypatch, clock) -> None:
    """`clock` as the wall timer every load takes by default: the cache cannot tell it from the real one."""
    for module in (linear_timing, cpu_linear, float_dtype):
        monkeypatch.setattr(module, "wall_timer" if module is linear_timing else "_wall_timer", clock)
    monkeypatch.setattr(linear_timing, "BACKOFF_S", 0.0)


@pytest.fixture(autouse=True)
def steady_clock(monkeypatch):
    """Each kernel the same time in every round, on all threads and on one: a quiet machine."""
    def steady(kernel, rows, fn):
        fn()
        return 1e-5 * (1 + len(kernel))  # linear (the shortest name) wins every race
    install_clock(monkeypatch, steady)
    return steady


class NeighbourHalfway:
    """A clock for races run while a neighbour's build starts halfway through each take: a candidate's
    calls take twice as long from the second half of its rounds on (the warm-up call and the first
    `quiet_rounds` are quiet). `takes` of the first are disturbed, the later ones quiet. Counts
    restart when the one-thread check runs, which ends a take."""

    def __init__(self, takes: int = 1_000, quiet_rounds: int = cpu_linear._MIN_CALLS // 2):
        self.takes, self.quiet_rounds, self.calls, self.take = takes, quiet_rounds, {}, 0

    def __call__(self, kernel, rows, fn):
        fn()
        if torch.get_num_threads() == 1:  # the one-thread check: the take is over
            if self.calls:
                self.take, self.calls = self.take + 1, {}
            return 1e-5
        self.calls[kernel] = self.calls.get(kernel, 0) + 1
        busy = self.take < self.takes and self.calls[kernel] > 1 + self.quiet_rounds
        return 2e-5 if busy else 1e-5


@pytest.fixture
def two_threads():
    """The races' one-thread check (and the end of a take it marks) needs torch on more than one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def record_races(monkeypatch) -> list[dict]:
    """Each plan's races per bucket, as choose_plan returns them."""
    seen: list[dict] = []
    real = cpu_linear.choose_plan

    def recording(*args, **kwargs):
        plan, timings, races = real(*args, **kwargs)
        seen.append(races)
        return plan, timings, races
    monkeypatch.setattr(cpu_linear, "choose_plan", recording)
    return seen


def stored() -> dict:
    """This machine's entries in the cache file, but its description."""
    entries = json.loads(linear_plan_cache.cache_path().read_text())[linear_plan_cache.machine_key()]
    return {name: record for name, record in entries.items() if name != linear_plan_cache.MACHINE}


def tiny_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False))


def count_timings(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cpu_linear.choose_plan  # (record_races may have wrapped it)

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(cpu_linear, "choose_plan", counting)
    return calls


def test_second_load_reads_the_plans_instead_of_timing(monkeypatch):
    calls = count_timings(monkeypatch)
    first = use_measured_linears(tiny_mlp(), "none", buckets=(1, 8))
    assert len(calls) == 2 and linear_plan_cache.cache_path().exists()
    model = tiny_mlp()
    second = use_measured_linears(model, "none", buckets=(1, 8))
    assert len(calls) == 2 and second == first  # nothing timed, same plans
    x = torch.randn(3, 64)
    layers = [m for m in model if isinstance(m, CpuLinear)]
    assert len(layers) == 2
    torch.testing.assert_close(model(x), tiny_mlp()(x), atol=1e-5, rtol=1e-5)  # cached plans still compute


def test_remeasure_other_machine_or_other_kernels_time_again(monkeypatch):
    calls = count_timings(monkeypatch)
    use_measured_linears(tiny_mlp(), "none", buckets=(1, 8))
    monkeypatch.setenv("TANDEM_REMEASURE", "1")
    use_measured_linears(tiny_mlp(), "none", buckets=(1, 8))
    assert len(calls) == 4
    monkeypatch.delenv("TANDEM_REMEASURE")
    use_measured_linears(tiny_mlp(), "int8", buckets=(1, 8))  # another candidate set: its own entry
    assert len(calls) == 6
    monkeypatch.setattr(linear_plan_cache, "kernels_digest", lambda: "edited-kernels")  # a kernel's code changed
    use_measured_linears(tiny_mlp(), "none", buckets=(1, 8))
    assert len(calls) == 8
    monkeypatch.setattr(linear_plan_cache, "machine_key", lambda: "another-cpu")
    use_measured_linears(tiny_mlp(), "none", buckets=(1, 8))
    assert len(calls) == 10


def test_injected_timer_never_reads_or_writes_the_cache(monkeypatch):
    def prefer_colmajor(name, rows, fn):
        fn()
        return 1.0 if name == "linear_colmajor" else 2.0
    plans = use_measured_linears(tiny_mlp(), "none", buckets=(1,), timer=prefer_colmajor)
    assert all(plan == [(1, "linear_colmajor")] for plan in plans.values())
    assert not linear_plan_cache.cache_path().exists()


def test_unreadable_cache_is_measured_over(monkeypatch):
    path = linear_plan_cache.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    calls = count_timings(monkeypatch)
    use_measured_linears(tiny_mlp(), "none", buckets=(1,))
    assert len(calls) == 2 and linear_plan_cache.lookup("nothing") is None


def test_dtype_auto_answer_is_kept():
    first = float_dtype.fastest_float_dtype(hidden=64, intermediate=96)
    stored = linear_plan_cache.lookup(f"dtype 64x96 native_bf16={float_dtype._native_bf16()}")
    assert stored == str(first).removeprefix("torch.")
    assert float_dtype.fastest_float_dtype(hidden=64, intermediate=96) == first


def test_a_kept_plan_records_when_it_was_measured_and_how_noisy():
    before = datetime.now().astimezone()
    plans = use_measured_linears(tiny_mlp(), "none", buckets=(1, 8))
    records = stored()
    assert len(records) == 2
    for record in records.values():
        assert record["answer"] in [[list(step) for step in plan] for plan in plans.values()]
        assert datetime.fromisoformat(record["measured_at"]) >= before.replace(microsecond=0)
        assert record["noise"] == 0.0 and record["retakes"] == 0 and record["one_thread_takes"] == 0
    machine = json.loads(linear_plan_cache.cache_path().read_text())[linear_plan_cache.machine_key()]["machine"]
    assert machine["threads"] == torch.get_num_threads() and machine["torch"] == torch.__version__ and machine["cpu"]


def test_a_plan_timed_while_a_neighbour_was_busy_is_retaken_and_not_kept(monkeypatch, caplog, two_threads):
    install_clock(monkeypatch, NeighbourHalfway())
    races = record_races(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kernels.cpu.linear_plan_cache"):
        use_measured_linears(tiny_mlp(), "none", buckets=(1, 8))
    for plan_races in races:
        assert plan_races[1].noisy and plan_races[1].retakes == linear_timing.RETAKES
        assert plan_races[1].noise == pytest.approx(1.0)  # the second half's best call took twice the first's
        assert plan_races[8].noisy and plan_races[8].retakes == 0  # the plan is not kept anyway: timed once
    assert not linear_plan_cache.cache_path().exists()
    not_cached = [r.message for r in caplog.records if "used for this load, not cached" in r.message]
    assert len(not_cached) == 2 and all("100 % apart" in line for line in not_cached)


def test_a_burst_that_passes_is_retaken_and_the_quiet_take_kept(monkeypatch, two_threads):
    install_clock(monkeypatch, NeighbourHalfway(takes=1))
    plans = use_measured_linears(tiny_mlp(), "none", buckets=(1, 8))
    records = stored()
    assert sorted(record["retakes"] for record in records.values()) == [0, 1]  # the first shape's first bucket
    for record in records.values():
        assert record["noise"] == 0.0
        assert record["answer"] in [[list(step) for step in plan] for plan in plans.values()]


def test_all_threads_slower_than_one_in_every_take_is_not_kept(monkeypatch, two_threads):
    """Where every take's threads wait for time slices (one-thread times stand in), the plan serves
    the load and is timed again by the next."""
    def oversubscribed(kernel, rows, fn):
        fn()
        return 1e-5 if torch.get_num_threads() == 1 else 4e-5
    install_clock(monkeypatch, oversubscribed)
    races = record_races(monkeypatch)
    use_measured_linears(tiny_mlp(), "none", buckets=(1,))
    assert all(r[1].contended and r[1].one_thread_takes == 1 + linear_timing.RETAKES for r in races)
    assert not linear_plan_cache.cache_path().exists()


def test_an_entry_in_the_older_format_is_timed_again_and_replaced(monkeypatch):
    """Before noise was recorded an entry held the bare plan; it may have been timed on a busy machine."""
    use_measured_linears(tiny_mlp(), "none", buckets=(1,))
    path = linear_plan_cache.cache_path()
    old = {key: {name: record["answer"] for name, record in entries.items() if name != "machine"}
           for key, entries in json.loads(path.read_text()).items()}
    path.write_text(json.dumps(old))
    calls = count_timings(monkeypatch)
    use_measured_linears(tiny_mlp(), "none", buckets=(1,))
    assert len(calls) == 2
    assert all(isinstance(record, dict) and "measured_at" in record for record in stored().values())


@pytest.mark.parametrize("content", ["[1, 2]", '{"%(key)s": "a string"}'])
def test_a_cache_file_of_the_wrong_shape_is_timed_over(monkeypatch, content):
    path = linear_plan_cache.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content % {"key": linear_plan_cache.machine_key()})
    calls = count_timings(monkeypatch)
    use_measured_linears(tiny_mlp(), "none", buckets=(1,))
    assert len(calls) == 2 and len(stored()) == 2


@pytest.mark.parametrize("record", [7, "linear", {"answer": None}, {"noise": 0.0}])
def test_an_entry_of_the_wrong_shape_is_timed_over(monkeypatch, record):
    use_measured_linears(tiny_mlp(), "none", buckets=(1,))
    path = linear_plan_cache.cache_path()
    cache = json.loads(path.read_text())
    cache[linear_plan_cache.machine_key()].update(dict.fromkeys(stored(), record))
    path.write_text(json.dumps(cache))
    calls = count_timings(monkeypatch)
    use_measured_linears(tiny_mlp(), "none", buckets=(1,))
    assert len(calls) == 2 and all(isinstance(r, dict) and "measured_at" in r for r in stored().values())


def test_a_dtype_race_timed_while_a_neighbour_was_busy_is_not_kept(monkeypatch, two_threads):
    install_clock(monkeypatch, NeighbourHalfway())
    float_dtype.fastest_float_dtype(hidden=64, intermediate=96)
    assert not linear_plan_cache.cache_path().exists()
