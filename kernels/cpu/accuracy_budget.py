"""Which linear kernels `auto` may choose: those that lose no more on a layer than its accuracy budget.

The budget of a layer is what the model's own float arithmetic loses there: the product in the weight's dtype
(`F.linear`, bf16 for a bf16 model). A kernel is within it when its relative error against the exact product
(fp32, the weight as stored) is at most `MARGIN` times the budget's, measured at load on calibration rows: a
few roundings to the dtype, as a layer's own ops round its activations, weights and outputs.
Float kernels in the weight's dtype are the budget's own arithmetic (kernels/cpu/linear.py checks them against
`F.linear` already) and always within it; every other kernel is measured.

Why not llama.cpp's loss, the figure users compare with: on SmolLM2's GGUF, llama.cpp's arithmetic (the
weights' own codes times activations rounded to int8 per block of 32, `int8_blockwise`) moves each layer's
outputs several times as far as bf16 does (docs/cpu-kernels.md#the-accuracy-budget), and with it on the q/k/v
projections alone the greedy answer to "What is the capital of France?" turns from Paris to "L'Étoile, ..."
(tests/test_default_model.py).
Within the bf16 budget, `auto` keeps the GGUF's exact 4-bit GEMVs and bf16 products, and the whole model
stays within llama.cpp's perplexity loss (docs/quality.md). The verdict still reports llama.cpp's error on
GGUF weights, for the log. Kernels past the budget (int8_blockwise, per-token W8A8, int8 weight-only where
it loses more) run only when asked for (`--quantization int8`, `--linear-kernels`), and the log and
GetEngineInfo name them.

Calibration rows are fixed random activations shaped like the real ones: channels of very different size
(an RMSNorm's gain), and, for an input with outlier channels (an MLP's SiLU·mul before down_proj), a few
channels tens of times larger. Fixed, so a load on any machine reaches the same verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cpu.int8_blockwise import int8_blockwise_is_exact
from kernels.reference import linear as reference_linear

# A kernel may move a layer's outputs as far as this many roundings to the dtype do: the line sits above the
# GGUF's exact 4-bit kernels and below llama.cpp's arithmetic, as measured (docs/cpu-kernels.md#the-accuracy-budget).
MARGIN = 3.5
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

    budget: float  # the error of the product in the weight's own dtype
    dtype: str  # that dtype, e.g. "bfloat16"
    llama_cpp: float | None = None  # llama.cpp's arithmetic's error on these weights, where they are GGUF blocks
    errors: dict[str, float] = field(default_factory=dict)

    def within(self, kernel: str) -> bool:
        return self.errors.get(kernel, 0.0) <= MARGIN * self.budget

    def describe(self, kernels) -> str:
        parts = [f"{name} {self.errors[name] * 100:.2f} %{'' if self.within(name) else ' (lossy)'}"
                 for name in kernels if name in self.errors]
        llama_cpp = "" if self.llama_cpp is None else f"; llama.cpp's arithmetic {self.llama_cpp * 100:.2f} %"
        return (f"budget {self.budget * 100:.2f} % ({self.dtype} F.linear) x {MARGIN:g}{llama_cpp}"
                + (f"; {', '.join(parts)}" if parts else ""))


def measure(weight: torch.Tensor, bias: torch.Tensor | None, kernels, float_kernels, run, outliers: bool,
            ) -> AccuracyVerdict:
    """The verdict on `kernels` for this weight: `run(kernel, x)` computes the kernel's output on x (the
    caller prepared its state); the kernels in `float_kernels` are not run (within by definition)."""
    x = calibration_rows(weight.shape[1], weight.dtype, outliers)
    exact = reference_linear.float_linear(x, weight, bias)
    dtype = str(weight.dtype).removeprefix("torch.")
    verdict = AccuracyVerdict(relative_error(F.linear(x, weight, bias), exact), dtype)
    if int8_blockwise_is_exact(weight):
        verdict.llama_cpp = relative_error(reference_linear.int8_blockwise(x, weight, bias), exact)
    for name in kernels:
        if name not in float_kernels:
            verdict.errors[name] = relative_error(run(name, x), exact)
    return verdict
