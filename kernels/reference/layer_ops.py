"""The fused layer ops and argmax in plain torch: the reference of kernels/fused_ops.py (C++) and
kernels/triton/fused_ops.py, and the torch path of the decoder layers (engine_core/models/layers.py
calls these when no fused ops are selected).

Shapes as the kernels take them: x [T, hidden] for the norms, [T, H, D] with cos, sin [T, 1, D/2]
for rotary, [T, 2I] for the gated activations, logits [N, V] for argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, computed in fp32 and cast back (as Hugging Face does)."""
    if x.dtype == torch.float32:  # one fused op, the same math
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual): vLLM's fused add + norm, the sum being the
    next residual. New tensors here; the kernels write both into x's and residual's buffers."""
    x = x + residual
    return rms_norm(x, weight, eps), x


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] by per-token angles (rotate_half layout); returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused gate_up projection: [T, 2I] -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's GeGLU): [T, 2I] -> [T, I]. No kernel replaces it yet."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] -> [N] int64: the first index of each row's maximum (a NaN counts as the max)."""
    return logits.argmax(dim=-1)
