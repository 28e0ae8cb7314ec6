"""Planning a model for this CPU, the kernels' one planning call: the engine says what the model computes
and never times a kernel itself.

- `fastest_float_dtype` (dtype=auto): bfloat16 or float32, whichever multiplies the model's shapes faster
  here. The CPU's flags name the expected winner (AVX-512 BF16 or AMX: bf16), a short race between the two
  dtypes' fastest float kernels (kernels/cpu/linear.py) can overturn it, and the answer is kept per machine
  in kernels/cpu/linear_plan_cache.py like the linear plans.
- `plan_cpu_model`: every linear on the kernel measured fastest per batch bucket within its accuracy budget,
  or pinned (kernels/cpu/linear.py), then the decoder layers as one C++ op each where that measures faster
  (kernels/cpu/decode_layers.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Callable

import torch
from torch import nn

from kernels.cpu import linear_plan_cache, linear_timing
from kernels.cpu.decode_layers import CpuDecodeLayers, DecoderStack, choose_decode_layers
from kernels.cpu.linear import (
    _BUDGET_S,
    _MIN_CALLS,
    _TIMING_BYTES,
    FLOAT_KERNELS,
    KERNELS,
    LinearRole,
    Pins,
    kernel_fits,
    use_measured_linears,
)
from kernels.cpu.linear_timing import RETAKES, Timer, one_thread, rotating, settled_race
from kernels.cpu.linear_timing import wall_timer as _wall_timer  # a module global: tests swap the clock here

logger = logging.getLogger(__name__)

_DTYPE_MARGIN = 3.0  # dtype=auto leaves the CPU flags' choice only for a dtype this many times faster


def _native_bf16() -> bool:
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def fastest_float_dtype(hidden: int, intermediate: int, timer: Timer | None = None,
                        native_bf16: bool | None = None) -> torch.dtype:
    """bfloat16 or float32, whichever multiplies an MLP-shaped weight faster here at 1 and 32 rows,
    each dtype through its fastest float kernel (row-major F.linear is not always it: on an AMD
    Zen 4 bf16 F.linear at 1 row is several times slower than the same weight prepacked for oneDNN).

    bf16 halves the bytes read, but CPUs without bf16 dot products emulate it several times slower.
    The CPU's flags (`native_bf16`, default: AVX-512 BF16 or AMX) name the expected winner, and the
    measurement overturns it only by a clear margin (`_DTYPE_MARGIN`): on a shared machine one dtype
    can miss every quiet moment of a short race, and either can look the faster by far
    (docs/cpu-kernels.md#timings-taken-on-a-busy-machine). Candidates reach `timer` named "kernel/dtype".
    """
    if native_bf16 is None:
        native_bf16 = _native_bf16()
    timer = timer or _wall_timer  # a module global, like cpu_linear's: tests swap the clock here
    cached = timer is linear_timing.wall_timer
    entry = f"dtype {hidden}x{intermediate} native_bf16={native_bf16}"
    stored = linear_plan_cache.lookup(entry) if cached else None
    if stored in ("bfloat16", "float32"):
        logger.info("dtype auto -> %s (measured on an earlier load)", stored)
        return getattr(torch, stored)
    count = max(1, _TIMING_BYTES // (hidden * intermediate * 4))
    totals = {torch.bfloat16: 0.0, torch.float32: 0.0}
    races = []
    for dtype in totals:
        name = str(dtype).removeprefix("torch.")
        with one_thread():
            weights = [torch.randn(intermediate, hidden, dtype=dtype) for _ in range(count)]
            kernels = [k for k in FLOAT_KERNELS if kernel_fits(k, weights[0])]
            states = {k: [KERNELS[k][0](w, None) for w in weights] for k in kernels}
        for rows in (1, 32):
            x = torch.randn(rows, hidden, dtype=dtype)
            candidates = {f"{k}/{name}": rotating(KERNELS[k][1], states[k], x) for k in kernels}
            retakes = 0 if any(race.noisy for race in races) else RETAKES  # one stayed noisy: not kept anyway
            races.append(settled_race(candidates, rows, timer, retakes, min_rounds=2 * _MIN_CALLS,
                                      max_rounds=8 * _MIN_CALLS, budget_s=_BUDGET_S))
            totals[dtype] += min(races[-1].timings.values())
    expected, other = (torch.bfloat16, torch.float32) if native_bf16 else (torch.float32, torch.bfloat16)
    choice = other if totals[other] * _DTYPE_MARGIN < totals[expected] else expected
    logger.info("dtype auto -> %s (CPU flags expect %s; best float kernel on one of %d weights, at 1 + 32 rows: "
                "bf16 %.0f us, fp32 %.0f us)", str(choice).removeprefix("torch."),
                str(expected).removeprefix("torch."), count, totals[torch.bfloat16] * 1e6, totals[torch.float32] * 1e6)
    if cached:
        linear_plan_cache.keep(entry, str(choice).removeprefix("torch."), races)
    return choice


def plan_cpu_model(model: nn.Module, quantization: str = "none", *, roles: Mapping[str, LinearRole] | None = None,
                   pins: Pins | None = None, decoder_stack: Callable[[], DecoderStack | None] | None = None,
                   timer: Timer | None = None, layer_timer: Timer | None = None,
                   kv_cache_dtype: torch.dtype | None = None) -> CpuDecodeLayers | None:
    """Plan `model` for this CPU: swap every `nn.Linear` for a `CpuLinear` on the kernels measured fastest per
    batch bucket among those `quantization` allows in its role (`roles`, by attribute name) within its accuracy
    budget, or `pins` (kernels/cpu/linear.py); then, where `decoder_stack()` describes the layers (None: they
    are not the op's shape, or the caller wants no op, as batch-invariant mode), time them as one C++ op each
    against the modules and return the op for the decode buckets it wins (None where it never does).

    `timer`: the linears' clock (None: the wall clock, with plans cached per machine); `layer_timer`: the
    decoder layers' (None: the wall clock); `kv_cache_dtype`: the KV cache the layers read (None: the model's
    dtype), which the op is timed on."""
    before = decoder_stack() if decoder_stack is not None else None
    # the float weights, taken before a plan may free them: the op makes its GEMV states from them
    weights = [[linear.weight for linear in layer.linears] for layer in before.layers] if before else None
    use_measured_linears(model, quantization, timer=timer, roles=roles, pins=pins)
    if weights is None:
        return None
    return choose_decode_layers(decoder_stack(), weights, quantization, layer_timer or linear_timing.wall_timer,
                                kv_cache_dtype)
