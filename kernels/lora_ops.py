"""The LoRA kernels behind one choice: Triton on CUDA, on the CPU the kernel measured fastest.

`select_lora_ops(device, kernel, attention_backend)` returns a `LoraOps`; the engine asks it for
each LoRA layer's `LoraPlan` (`plan_for(in, out, rank)`), whose `add(y, x, A, B, index)` adds
every row's adapter product into y in place (the contract of kernels/cpu/lora.py).

On the CPU "auto" times the kernels of kernels/cpu/lora.py on each layer shape at each row
bucket, with the step's rows spread over every slot in adapter order (as the runner orders them),
against the plain per-slot matmul, and keeps the fastest per bucket, as kernels/cpu/linear.py
does for the linears; a kernel name forces one kernel everywhere (tests, debugging).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from kernels.cpu.linear_timing import Timer, fastest_uncontended, wall_timer
from kernels.cpu.lora import CPU_LORA_KERNELS, MAX_ROWS, cpu_lora_kernel_available
from kernels.lora_index import LoraStepIndex

logger = logging.getLogger(__name__)

BUCKETS = (1, 8, 32, 128, 512)
LORA_KERNELS = ("auto", "triton", *CPU_LORA_KERNELS)
_MIN_CALLS = 5
_BUDGET_S = 0.01  # timed seconds per bucket and shape, all kernels together

AddLora = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LoraStepIndex], None]


@dataclass
class LoraPlan:
    """The kernel per row bucket for one layer shape: (max rows, name), ascending; the last takes more."""

    steps: list[tuple[int, str]]
    _runs: list[tuple[int, AddLora]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._runs = [(limit, _KERNELS[name]) for limit, name in self.steps]

    def add(self, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, index: LoraStepIndex) -> None:
        rows = x.shape[0]
        for limit, run in self._runs:
            if rows <= limit:
                return run(y, x, a, b, index)
        return self._runs[-1][1](y, x, a, b, index)

    def kernel_for(self, rows: int) -> str:
        return next((name for limit, name in self.steps if rows <= limit), self.steps[-1][1])


def _triton_add(y, x, a, b, index):
    from kernels.triton.lora import add_lora_triton

    add_lora_triton(y, x, a, b, index)


_KERNELS: dict[str, AddLora] = {**CPU_LORA_KERNELS, "triton": _triton_add}


class LoraOps:
    """Plans LoRA layers: one fixed kernel, or on the CPU the fastest per bucket (measured once per shape)."""

    def __init__(self, kernel: str, num_slots: int, dtype: torch.dtype, timer: Timer = wall_timer,
                 slot_dtype: torch.dtype | None = None) -> None:
        self.kernel = kernel  # "auto" (CPU, measured) or a kernel name
        self.num_slots = num_slots
        self.dtype = dtype  # the activations'
        self.slot_dtype = slot_dtype or dtype  # the adapters' weights and products'
        self.timer = timer
        self._plans: dict[tuple[int, int, int], LoraPlan] = {}

    @property
    def name(self) -> str:
        return "cpu (measured)" if self.kernel == "auto" else self.kernel

    def plan_for(self, in_features: int, out_features: int, rank: int) -> LoraPlan:
        key = (in_features, out_features, rank)
        if key not in self._plans:
            if self.kernel != "auto":
                self._plans[key] = LoraPlan([(BUCKETS[-1], self.kernel)])
            else:
                self._plans[key] = choose_lora_plan(in_features, out_features, rank, self.num_slots, self.dtype,
                                                    timer=self.timer, slot_dtype=self.slot_dtype)
        return self._plans[key]


def select_lora_ops(device: str, num_slots: int, dtype: torch.dtype, kernel: str = "auto",
                    attention_backend: str = "auto") -> LoraOps:
    """Triton on CUDA (and wherever attention runs Triton, as the interpreter tests do); on the CPU
    the measured kernels; `kernel` names one kernel instead. The adapters' weights are kept in fp32 on the
    CPU (their products cost a fraction of bf16's there, kernels/cpu/lora.py), in `dtype` on CUDA."""
    if kernel not in LORA_KERNELS:
        raise ValueError(f"lora kernel must be one of {LORA_KERNELS}, got {kernel!r}")
    if kernel == "auto" and (device.startswith("cuda") or attention_backend == "triton"):
        kernel = "triton"
    if kernel != "triton" and device.startswith("cuda"):
        raise ValueError(f"lora kernel {kernel!r} is a CPU kernel; on CUDA use 'triton' or 'auto'")
    if kernel in CPU_LORA_KERNELS and not cpu_lora_kernel_available(kernel):
        raise ValueError(f"lora kernel {kernel!r} needs Tandem's C++ CPU kernels, which could not be built here "
                         "(see the log); use 'auto'")
    return LoraOps(kernel, num_slots, dtype, slot_dtype=torch.float32 if device == "cpu" else dtype)


def timing_index(rows: int, num_slots: int, dtype: torch.dtype) -> LoraStepIndex:
    """Rows spread evenly over the slots, in runs by slot, as a busy step of many adapters has them."""
    return LoraStepIndex([row * num_slots // rows for row in range(rows)], num_slots, torch.device("cpu"), dtype)


@torch.inference_mode()
def choose_lora_plan(in_features: int, out_features: int, rank: int, num_slots: int, dtype: torch.dtype,
                     buckets: tuple[int, ...] = BUCKETS, timer: Timer = wall_timer,
                     slot_dtype: torch.dtype | None = None) -> LoraPlan:
    """Time each CPU kernel at each bucket on random slot tensors of this shape (activations in `dtype`, the
    slots in `slot_dtype`, default the same); the fastest per bucket."""
    slot_dtype = slot_dtype or dtype
    a = torch.randn(num_slots, rank, in_features, dtype=slot_dtype) * 0.01
    b = torch.randn(num_slots, rank, out_features, dtype=slot_dtype) * 0.01
    steps, report = [], []
    for rows in buckets:
        x = torch.randn(rows, in_features, dtype=dtype)
        y = torch.zeros(rows, out_features, dtype=dtype)
        index = timing_index(rows, num_slots, slot_dtype)
        fit = [name for name in CPU_LORA_KERNELS
               if rows <= MAX_ROWS.get(name, rows) and cpu_lora_kernel_available(name)]
        candidates = {name: (lambda run=CPU_LORA_KERNELS[name]: run(y, x, a, b, index)) for name in fit}
        timings, _ = fastest_uncontended(candidates, rows, timer, min_rounds=_MIN_CALLS, max_rounds=4 * _MIN_CALLS,
                                         budget_s=_BUDGET_S)
        best = min(timings, key=timings.get)
        steps.append((rows, best))
        report.append(f"{rows}:{best}({timings[best] * 1e6:.0f}us, per_slot {timings['per_slot'] * 1e6:.0f}us)")
    logger.info("lora %dx%d rank %d over %d slots: %s", out_features, in_features, rank, num_slots, ", ".join(report))
    return LoraPlan(steps)
