"""Which linear kernels `auto` may choose: those that lose no more on a layer than the accuracy budget allows.

The budget of a layer is what the model's own arithmetic already loses there: for weights that came from a
GGUF's blocks (Q4_0 / Q4_1 / Q8_0, `int8_blockwise_is_exact`), llama.cpp's arithmetic on the same weights
(their own codes times activations rounded to int8 per block of 32); for any other weight, the product in the
weight's own dtype (`F.linear`). A kernel is within it when its relative error against the exact product
(fp32, the weight as stored) is at most `MARGIN` times the budget's, measured at load on calibration rows.

Float kernels in the weight's dtype are the budget's own arithmetic (kernels/cpu_linear.py checks them against
`F.linear` already) and always within it. Every other kernel is measured: per-token W8A8 on 4-bit weights
rounds the weights a second time and lands at 3-4x llama.cpp's error, so `auto` leaves it out; it stays
available as a lossy option the user asks for (`--quantization int8`), and the log and GetEngineInfo name it
(docs/cpu-kernels.md#accuracy, docs/quality.md for the end-to-end figures).

Calibration rows are fixed random activations shaped like the real ones: channels of very different size
(an RMSNorm's gain), and, for an input with outlier channels (an MLP's SiLU·mul before down_proj), a few
channels tens of times larger. Fixed, so a load on any machine reaches the same verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.int8_blockwise import int8_blockwise_is_exact
from kernels.reference import linear as reference_linear

MARGIN = 1.25  # a kernel may lose this many times the budget's error (its output rounding, summation order)
CALIBRATION_ROWS = 64
_SEED = 20261128
_OUTLIER_CHANNELS = 8  # per outlier input: a few channels ...
_OUTLIER_SCALE = 30.0  # ... this many times the others (SmoothQuant's observation on MLP inputs)


def calibration_rows(in_features: int, dtype: torch.dtype, outliers: bool,
                     rows: int = CALIBRATION_ROWS) -> torch.Tensor:
    """Fixed activations [rows, in_features] in `dtype`: log-normal channel sizes, outlier channels if asked."""
    generator = torch.Generator().manual_seed(_SEED + in_features)
    channel_size = torch.exp(0.5 * torch.randn(in_features, generator=generator))
    if outliers:
        picked = torch.randperm(in_features, generator=generator)[:_OUTLIER_CHANNELS]
        channel_size[picked] *= _OUTLIER_SCALE
    return (torch.randn(rows, in_features, generator=generator) * channel_size).to(dtype)


def relative_error(y: torch.Tensor, exact: torch.Tensor) -> float:
    """mean |y - exact| / mean |exact|: how far a layer's outputs moved, on the outputs' own scale."""
    exact = exact.double()
    return ((y.double() - exact).abs().mean() / exact.abs().mean().clamp(min=1e-30)).item()


@dataclass
class AccuracyVerdict:
    """The budget of one layer shape and role and each measured kernel's error (relative, see above)."""

    reference: str  # whose arithmetic sets the budget: "llama.cpp (int8 per block of 32)" or "bfloat16 F.linear"
    budget: float  # the budget's own error
    errors: dict[str, float] = field(default_factory=dict)

    def within(self, kernel: str) -> bool:
        return self.errors.get(kernel, 0.0) <= MARGIN * self.budget

    def describe(self, kernels) -> str:
        parts = [f"{name} {self.errors[name] * 100:.2f} %{'' if self.within(name) else ' (lossy)'}"
                 for name in kernels if name in self.errors]
        return (f"budget {self.budget * 100:.2f} % ({self.reference}) x {MARGIN:g}"
                + (f"; {', '.join(parts)}" if parts else ""))


def measure(weight: torch.Tensor, bias: torch.Tensor | None, kernels, float_kernels, run, outliers: bool,
            ) -> AccuracyVerdict:
    """The verdict on `kernels` for this weight: `run(kernel, x)` computes the kernel's output on x (the
    caller prepared its state); the kernels in `float_kernels` are not run (within by definition)."""
    x = calibration_rows(weight.shape[1], weight.dtype, outliers)
    exact = reference_linear.float_linear(x, weight, bias)
    if int8_blockwise_is_exact(weight):
        verdict = AccuracyVerdict("llama.cpp: the weights' codes x int8 activations per block of 32",
                                  relative_error(reference_linear.int8_blockwise(x, weight, bias), exact))
    else:
        dtype = str(weight.dtype).removeprefix("torch.")
        verdict = AccuracyVerdict(f"{dtype} F.linear", relative_error(F.linear(x, weight, bias), exact))
    for name in kernels:
        if name not in float_kernels:
            verdict.errors[name] = relative_error(run(name, x), exact)
    return verdict
