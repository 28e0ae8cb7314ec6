"""The elementwise chain of a decoder layer as single C++ passes (kernels/cpu/csrc/fused_ops.cpp).

A Llama layer between its matmuls is RMSNorm, rotary on q/k, SiLU * mul and two residual
adds: in eager torch that is some 20 small ops and their temporaries per layer, which at
decode batch sizes cost more than the arithmetic. `FusedOps` does each in one pass over the
rows, in place where the inputs are the step's own temporaries.

`select_fused_ops(device, dtype)` returns them for CPU fp32 / bf16 models when the C++
kernels are built (kernels/cpu/extension.py), their Triton twins for CUDA models
(kernels/triton/fused_ops.py), else None: the model's layers then run their plain torch
code (engine_core/models/layers.py), which calls the reference.

`argmax` is greedy sampling's pick, exactly torch.argmax's answer, several times faster on
CPU fp32 logits (kernels/cpu/csrc/argmax.cpp) and the reference everywhere else.

Reference: kernels/reference/layer_ops.py (`rms_norm`, `fused_add_rms_norm`, `apply_rotary`,
`silu_and_mul`, `argmax`).
"""

from __future__ import annotations

import torch

from kernels.cpu import extension as cpu_extension
from kernels.reference import layer_ops as reference

DTYPES = (torch.float32, torch.bfloat16)


class FusedOps:
    """The C++ fused ops with the calling conventions of the torch layers they replace."""

    name = "cpp"

    @staticmethod
    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: rms_norm(x) * weight. With it: (rms_norm(x + residual) * weight,
        x + residual), computed in place in x's and residual's buffers (both [T, hidden])."""
        if residual is None:
            out = torch.empty(x.shape, dtype=x.dtype)
            torch.ops.tandem.rms_norm(out, x, weight, eps)
            return out
        torch.ops.tandem.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    @staticmethod
    def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, H, D] in place by cos, sin [T, 1, D/2] (rotate_half layout); returns x."""
        torch.ops.tandem.rotary_embedding(x, cos.squeeze(1), sin.squeeze(1))
        return x

    @staticmethod
    def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> silu(x[:, :I]) * x[:, I:] as [T, I]."""
        out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
        torch.ops.tandem.silu_and_mul(out, x)
        return out


def select_fused_ops(device: str, dtype: torch.dtype):
    """FusedOps for a CPU model in fp32 / bf16 when the C++ kernels load, TritonFusedOps for
    a CUDA model, else None."""
    if device.startswith("cuda"):
        from kernels.triton.fused_ops import DTYPES as TRITON_DTYPES
        from kernels.triton.fused_ops import TritonFusedOps

        return TritonFusedOps() if dtype in TRITON_DTYPES else None
    if device != "cpu" or dtype not in DTYPES or not cpu_extension.load():
        return None
    return FusedOps()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: the first index of each row's maximum (a NaN counts as the max)."""
    if logits.is_cpu and logits.dtype == torch.float32 and logits.shape[-1] >= 16 and cpu_extension.load():
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        torch.ops.tandem.argmax_rows(out, logits)
        return out
    return reference.argmax(logits)
