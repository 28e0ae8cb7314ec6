"""Gemma 2 and Gemma 3 (text) decoders: the Llama model and attention with Gemma's layer.

Where Gemma differs from Llama:
- embeddings scaled by sqrt(hidden) (`embed_scale`);
- RMSNorm multiplies by (1 + w): the loader adds the 1 once (`adapt_weight`), so the same
  RMSNorm (and its fused kernel) serves;
- four norms per layer: the attention and MLP outputs are normalized before each residual add;
- GeGLU MLP (gelu-tanh gate);
- attention scale query_pre_attn_scalar^-1/2, local (sliding-window) and global layers
  alternating by `layer_types`, Gemma 2's logit soft-caps on scores and logits, Gemma 3's
  q/k norm and its own rope base for local layers: all from ModelArchConfig, in LlamaAttention.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_core.config import ModelArchConfig
from engine_core.models.layers import GeluAndMul, RMSNorm
from engine_core.models.llama import KVCache, LlamaAttention, LlamaForCausalLM, LlamaMLP, Rope
from kernels import AttentionBackend, AttentionMetadata, FusedOps


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelArchConfig, attention: AttentionBackend, fused: FusedOps | None = None, layer: int = 0
    ):
        super().__init__()
        self.sliding = config.is_sliding(layer)
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, fused)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = LlamaAttention(config, attention, fused, layer)
        self.mlp = LlamaMLP(config, fused)
        self.mlp.act = GeluAndMul()

    def forward(self, rope: Rope, x, residual, kv_cache: KVCache, md: AttentionMetadata):
        """(x, residual) -> (x, residual), the residual added inside the next norm as in Llama."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(rope, x, kv_cache, md))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text causal LM (tied embeddings)."""

    layer_cls = GemmaDecoderLayer

    def __init__(self, config: ModelArchConfig, attention: AttentionBackend, fused: FusedOps | None = None):
        super().__init__(config, attention, fused)
        self.model.embed_scale = config.hidden_size**0.5

    def adapt_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.float() + 1.0 if name.endswith("norm.weight") else tensor
