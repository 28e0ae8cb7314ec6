"""Building blocks of the decoders: RMSNorm, rotary embedding, SiluAndMul, GeluAndMul.

Every layer works on one flattened ragged batch: tensors are [T, ...] with no batch
dimension, and token t's position comes from a flat `positions` tensor. The rotary
cos/sin are looked up once per step and shared by every layer.

Their torch path is the kernels' reference (kernels/reference/layer_ops.py, called here). Given
`fused` (kernels.fused_ops.FusedOps), RMSNorm, SiluAndMul and `apply_rotary` run as single C++
passes instead, with the same results within rounding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kernels import FusedOps, LinearRole, reference

# What the kernels must know of these layers' linears, by attribute name (the CPU linears' choice,
# kernels/cpu/linear.py): the LM head sees decode-sized batches and loses most to int4; the MLP's down
# projection reads the SiLU·mul product, whose outlier channels per-token W8A8 crushes.
LINEAR_ROLES = {"lm_head": LinearRole.OUTPUT_HEAD, "down_proj": LinearRole.OUTLIER_INPUT}


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as Hugging Face does).

    With `residual` (vLLM's fused add + norm): returns (norm(x + residual), x + residual),
    the sum being the next residual; the fused path computes both in x's and residual's
    buffers, so callers pass the step's own temporaries.
    """

    def __init__(self, dim: int, eps: float, fused: FusedOps | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fused = fused

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.fused is not None:
            return self.fused.rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return reference.layer_ops.rms_norm(x, self.weight, self.eps)
        return reference.layer_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class SiluAndMul(nn.Module):
    """silu(gate) * up for the fused gate_up projection: [T, 2I] -> [T, I]."""

    def __init__(self, fused: FusedOps | None = None) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused.silu_and_mul(x)
        return reference.layer_ops.silu_and_mul(x)


class GeluAndMul(nn.Module):
    """gelu_tanh(gate) * up (Gemma's GeGLU): [T, 2I] -> [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reference.layer_ops.gelu_and_mul(x)


class RotaryEmbedding(nn.Module):
    """NeoX / Hugging Face "rotate_half" rotary embedding over a precomputed cos/sin cache.

    The cache ([max_position, head_dim] = cos | sin halves, fp32) is built on the CPU, so
    it is real even when the model is constructed on the meta device; `model.to(device)`
    moves it.
    """

    def __init__(
        self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None
    ) -> None:
        super().__init__()
        t = torch.arange(max_position, dtype=torch.float32, device="cpu")
        if (rope_scaling or {}).get("rope_type") == "longrope":
            freqs, factor = _longrope_freqs(t, head_dim, base, rope_scaling)
        else:
            freqs, factor = torch.outer(t, rope_inv_freq(head_dim, base, rope_scaling)), 1.0  # [P, D/2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * factor  # [P, D]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] int64 -> (cos, sin), each [T, 1, D/2] in `dtype`, for `apply_rotary`."""
        cos, sin = self.cos_sin_cache[positions].to(dtype).unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


# Rotate x [T, H, D] by per-token angles (rotate_half layout), a new tensor: the torch path of rotary.
apply_rotary = reference.layer_ops.apply_rotary


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], adjusted per rope_scaling type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = (rope_scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: linear, llama3, longrope)")


def _longrope_freqs(t: torch.Tensor, head_dim: int, base: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """Phi-3 LongRoPE: frequencies divided by `short_factor` per dimension within the original
    context and by `long_factor` beyond it, cos/sin scaled by the attention factor. Chosen per
    position, as vLLM does (transformers switches a whole sequence to the long factors once
    it grows past the original context)."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    inv_freq = rope_inv_freq(head_dim, base, None)
    short = torch.outer(t, inv_freq / torch.tensor(scaling["short_factor"], device="cpu"))
    long = torch.outer(t, inv_freq / torch.tensor(scaling["long_factor"], device="cpu"))
    return torch.where(t[:, None] < original, short, long), attention_factor


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1: divide low frequencies by `factor`, keep high ones, blend in between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen < old_len / high, inv_freq, blended)
    return torch.where(wavelen > old_len / low, inv_freq / factor, scaled)
