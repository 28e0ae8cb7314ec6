"""Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2/2.5, Qwen3, Phi-3)
over paged KV.

The families differ from Llama in a few places, each read from ModelArchConfig: q/k/v
biases (Qwen2), per-head q/k RMSNorm (Qwen3), sliding-window layers (Mistral, Qwen2 when
on, Phi-3), LongRoPE (Phi-3, whose checkpoints already hold qkv_proj and gate_up_proj).
Gemma (engine_core/models/gemma.py) reuses the attention and the model with its own layer.

One forward runs one flattened ragged batch: T tokens of many requests, no batch
dimension and no padding. Attention goes through an `AttentionBackend`, which writes
this step's keys and values into the paged cache and reads each request's context
back through its block table.

Parameter names follow Hugging Face, except that q/k/v and gate/up are fused into
`qkv_proj` and `gate_up_proj`; `packed_groups` is the one place that says so.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from engine_core.config import ModelArchConfig
from engine_core.models.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary
from kernels import AttentionBackend, AttentionMetadata, DecoderLayerSpec, DecoderStack, FusedOps

KVCache = tuple[torch.Tensor, torch.Tensor]  # key, value: [num_blocks, Hkv, block_size, D]
Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, D/2], looked up once per step

# checkpoint module name -> (fused module name, shard index)
_PACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_PACKED_SIZES = {"qkv_proj": 3, "gate_up_proj": 2}


class LlamaAttention(nn.Module):
    def __init__(
        self, config: ModelArchConfig, attention: AttentionBackend, fused: FusedOps | None = None, layer: int = 0
    ):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = config.sliding_window if config.is_sliding(layer) else None
        self.softcap = config.attn_logit_softcap
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # over each head's D values, before rope
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, fused)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qk_size, self.v_size = q_size + kv_size, kv_size
        # Llama's attention_bias covers o_proj too; Qwen2 biases q/k/v only
        o_bias = config.attention_bias and config.name != "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=o_bias)
        self.attention = attention
        self.rotate = apply_rotary if fused is None else fused.apply_rotary

    def forward(self, rope: Rope, x, kv_cache: KVCache, md: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.qk_size, self.v_size], dim=-1)
        qk = qk.view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            qk = self.rotate(qk, *rope)
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [T, H, D], [T, Hkv, D]
        else:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q = self.rotate(self.q_norm(q.reshape(-1, self.head_dim)).view(T, self.num_heads, -1), *rope)
            k = self.rotate(self.k_norm(k.reshape(-1, self.head_dim)).view(T, self.num_kv_heads, -1), *rope)
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        key_cache, value_cache = kv_cache
        self.attention.write_kv_cache(k, v, key_cache, value_cache, md.slot_mapping, md)
        o = self.attention.paged_attention(
            q, key_cache, value_cache, md, self.scale, sliding_window=self.window, logit_softcap=self.softcap
        )  # [T, H, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelArchConfig, fused: FusedOps | None = None):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.act = SiluAndMul(fused)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelArchConfig, attention: AttentionBackend, fused: FusedOps | None = None, layer: int = 0
    ):
        super().__init__()
        self.sliding = config.is_sliding(layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.self_attn = LlamaAttention(config, attention, fused, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.mlp = LlamaMLP(config, fused)

    def forward(self, rope: Rope, x, residual, kv_cache: KVCache, md: AttentionMetadata):
        """(x, residual) -> (x, residual): the residual stream is added inside the next norm
        (vLLM's layout), so the fused path adds and normalizes in one pass. residual is None
        for the first layer."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, kv_cache, md)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def op_linears(layer: nn.Module) -> list[nn.Module]:
    """qkv, o, gate_up and down: a layer's linears in the one-op layer's order (kernels.DecoderLayerSpec)."""
    attn, mlp = layer.self_attn, layer.mlp
    return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]


def _runs_as_one_op(layer: nn.Module) -> bool:
    """A plain Llama layer without biases or q/k norms, on the C++ fused ops and attention."""
    if type(layer) is not LlamaDecoderLayer:
        return False
    fused = (layer.input_layernorm.fused, layer.post_attention_layernorm.fused, layer.mlp.act.fused)
    return (
        all(f is not None and f.name == "cpp" for f in fused)
        and layer.self_attn.attention.name == "cpp" and layer.self_attn.q_norm is None
        and not any(linear.has_bias if hasattr(linear, "has_bias") else linear.bias is not None  # CpuLinear, or not
                    for linear in op_linears(layer))
    )


class LlamaModel(nn.Module):
    def __init__(
        self, config: ModelArchConfig, attention: AttentionBackend, fused: FusedOps | None = None,
        layer_cls: type[nn.Module] = LlamaDecoderLayer,
    ):
        super().__init__()
        self.embed_scale: float | None = None  # Gemma: sqrt(hidden), rounded to the activations' dtype
        # an explicit weight skips the random init, which on the meta device imports torch._dynamo
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.local_rotary_emb = None  # sliding layers' own rope base (Gemma 3)
        if config.rope_local_theta is not None:
            self.local_rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                                    config.rope_local_theta)
        self.layers = nn.ModuleList(
            layer_cls(config, attention, fused, layer) for layer in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        # on CPU, the layers as one C++ op each for small decode steps (kernels.CpuDecodeLayers, planned from
        # `decoder_stack()`); set by the loader
        self.decode_layers = None
        self.lora = None  # the step's adapters (engine_core/lora), when the engine serves LoRA

    def decoder_stack(self) -> DecoderStack | None:
        """What the layers compute, for the kernels to run them as one C++ op each (kernels.plan_cpu_model);
        None where they are not that op's shape: biases, q/k norms, Gemma's layers or embedding scale, a second
        rope, or the torch attention or layer ops."""
        layers = list(self.layers)
        if not layers or self.local_rotary_emb is not None or self.embed_scale is not None:
            return None
        if not all(_runs_as_one_op(layer) for layer in layers):
            return None
        attn = layers[0].self_attn

        def modules(h, rope, kv_caches, md):
            residual = None
            for layer, kv_cache in zip(self.layers, kv_caches):
                h, residual = layer(rope, h, residual, kv_cache, md)

        return DecoderStack(
            layers=[DecoderLayerSpec(
                input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                eps=layer.input_layernorm.eps, linears=tuple(op_linears(layer)), scale=layer.self_attn.scale,
                window=layer.self_attn.window or 0, softcap=layer.self_attn.softcap or 0.0,
                batch_invariant=layer.self_attn.attention.batch_invariant) for layer in layers],
            num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            dtype=self.norm.weight.dtype, embed=self.embed_tokens, rope=self.rotary_emb, modules=modules,
        )

    def forward(self, input_ids, positions, kv_caches: list[KVCache], md: AttentionMetadata):
        h = self.embed_tokens(input_ids)  # [T, hidden]
        if self.embed_scale is not None:
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        rope = self.rotary_emb(positions, h.dtype)
        adapter_rows = self.lora is not None and self.lora.active
        if self.decode_layers is not None and h.shape[0] <= self.decode_layers.max_rows and (
                not adapter_rows or self.decode_layers.serves_lora):
            lora_rows = self.lora.index.slots if adapter_rows else None
            return self.norm(*self.decode_layers(h, rope, kv_caches, md, lora_rows))[0]
        local_rope = rope if self.local_rotary_emb is None else self.local_rotary_emb(positions, h.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(local_rope if layer.sliding else rope, h, residual, kv_cache, md)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over one flattened ragged batch with a paged KV cache.

    `fused`: the C++ elementwise ops (kernels.fused_ops) for the layers, or None for torch."""

    layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: ModelArchConfig, attention: AttentionBackend, fused: FusedOps | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, attention, fused, self.layer_cls)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one (key_cache, value_cache) per layer
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        """Run every layer over the batch, writing this step's K/V into the caches."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        if self.lm_head is None:  # tied; on CPU the loader gives the head its own measured linear
            logits = torch.nn.functional.linear(hidden, self.model.embed_tokens.weight).float()
        else:
            logits = self.lm_head(hidden).float()
        if (cap := self.config.final_logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], device: torch.device, dtype: torch.dtype
    ) -> None:
        """Assign every parameter from (name, tensor) pairs named as `packed_groups` names them.

        The model may be built on the meta device: each parameter is replaced by its tensor
        (moved to `device`, cast to `dtype`), so nothing is allocated twice. Raises KeyError
        for unknown or missing tensors and ValueError for shape mismatches.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.lm_head is None and name == "lm_head.weight"):
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no matching model parameter")
            if tuple(params[name].shape) != tuple(tensor.shape):
                expected = tuple(params[name].shape)
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {expected}")
            module_name, _, attr = name.rpartition(".")
            weight = nn.Parameter(self.adapt_weight(name, tensor).to(device=device, dtype=dtype), requires_grad=False)
            setattr(self.get_submodule(module_name), attr, weight)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise KeyError(f"checkpoint is missing tensors for: {', '.join(missing[:8])}{more}")
        self.to(device)  # buffers (the rotary cache) follow the weights


    def adapt_weight(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A family's change to a checkpoint tensor before it is cast (Gemma's norms)."""
        return tensor


def packed_groups(names: Iterable[str]) -> dict[str, list[str]]:
    """Group checkpoint tensor names by model parameter, in concatenation order.

    The one place that fuses: q/k/v -> qkv_proj and gate/up -> gate_up_proj (rows stacked
    in that order); every other name maps to itself. Loaders concatenate each group in
    their own domain (torch tensors, or raw quantized GGUF rows). Raises KeyError when a
    fused group is incomplete.
    """
    groups: dict[str, list[tuple[int, str]]] = {}
    sizes: dict[str, int] = {}
    for name in names:
        parts = name.split(".")
        fused, shard = _PACKED.get(parts[-2], (None, 0)) if len(parts) >= 2 else (None, 0)
        param = ".".join(parts[:-2] + [fused, parts[-1]]) if fused else name
        groups.setdefault(param, []).append((shard, name))
        sizes[param] = _PACKED_SIZES[fused] if fused else 1
    for param, shards in groups.items():
        if len(shards) != (expected := sizes[param]):
            raise KeyError(f"{param} fuses {expected} checkpoint tensors, found {[n for _, n in shards]}")
    return {param: [name for _, name in sorted(shards)] for param, shards in groups.items()}
