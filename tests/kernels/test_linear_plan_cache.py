"""Load-time linear plans and the dtype=auto answer are measured once per machine and read back
(kernels/linear_plan_cache.py); TANDEM_REMEASURE, another machine, changed kernel code or a kernel
no longer allowed measure again."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels import cpu_linear, float_dtype, linear_plan_cache
from kernels.cpu_linear import CpuLinear, use_measured_linears


@pytest.fixture(autouse=True)
def empty_cache(private_cache):
    return private_cache


def tiny_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64, bias=False))


def count_timings(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cpu_linear.choose_plan

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
