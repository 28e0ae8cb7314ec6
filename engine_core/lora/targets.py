"""Which of a model's modules take a LoRA adapter, and where PEFT's module names land in them.

PEFT names the modules of the Hugging Face model (`model.layers.3.self_attn.q_proj`); Tandem fuses
q/k/v into `qkv_proj` and gate/up into `gate_up_proj` (engine_core/models/llama.py), so each fused
module takes its shards' adapters as pieces: piece i's rank columns sit in block i of the slot,
its outputs at the shard's offset. Phi-3's checkpoints (and so its adapters) name the fused
modules themselves: one piece over every output. The LM head (when not tied to the embeddings)
and the embeddings take adapters too.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

LINEAR_LEAVES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                 "down_proj", "lm_head")
EMBEDDING_LEAF = "embed_tokens"


@dataclass(frozen=True)
class LoraPieceSpec:
    index: int  # block of rank columns in the slot
    offset: int  # first output of the piece
    size: int  # outputs of the piece


@dataclass(frozen=True)
class LoraTarget:
    path: str  # the module in Tandem's model, e.g. model.layers.0.self_attn.qkv_proj
    kind: str  # "linear" or "embedding"
    in_features: int  # for an embedding: the vocabulary
    out_features: int
    pieces: dict[str, LoraPieceSpec]  # PEFT leaf name -> piece
    num_pieces: int


def lora_targets(model: nn.Module) -> dict[str, LoraTarget]:
    """Every module of a Llama-family model (engine_core/models) that takes an adapter, by PEFT's
    module name (the Hugging Face model's): a fused module appears once per shard name."""
    targets: dict[str, LoraTarget] = {}
    decoder = model.model
    for i, layer in enumerate(decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        hidden, intermediate = mlp.down_proj.out_features, mlp.down_proj.in_features
        prefix = f"model.layers.{i}"
        qkv = _linear(f"{prefix}.self_attn.qkv_proj", hidden, q + 2 * kv,
                      {"q_proj": (0, 0, q), "k_proj": (1, q, kv), "v_proj": (2, q + kv, kv),
                       "qkv_proj": (0, 0, q + 2 * kv)}, 3)
        gate_up = _linear(f"{prefix}.mlp.gate_up_proj", hidden, 2 * intermediate,
                          {"gate_proj": (0, 0, intermediate), "up_proj": (1, intermediate, intermediate),
                           "gate_up_proj": (0, 0, 2 * intermediate)}, 2)
        o = _linear(f"{prefix}.self_attn.o_proj", q, hidden, {"o_proj": (0, 0, hidden)}, 1)
        down = _linear(f"{prefix}.mlp.down_proj", intermediate, hidden, {"down_proj": (0, 0, hidden)}, 1)
        for target, parent in ((qkv, "self_attn"), (o, "self_attn"), (gate_up, "mlp"), (down, "mlp")):
            for leaf in target.pieces:
                targets[f"{prefix}.{parent}.{leaf}"] = target
    vocab, hidden = decoder.embed_tokens.weight.shape
    targets["model.embed_tokens"] = LoraTarget("model.embed_tokens", "embedding", vocab, hidden,
                                               {EMBEDDING_LEAF: LoraPieceSpec(0, 0, hidden)}, 1)
    if not model.config.tie_word_embeddings:  # a tied head is the embedding: PEFT adapts it as such
        targets["lm_head"] = _linear("lm_head", hidden, vocab, {"lm_head": (0, 0, vocab)}, 1)
    return targets


def _linear(path: str, in_features: int, out_features: int, pieces: dict[str, tuple[int, int, int]],
            num_pieces: int) -> LoraTarget:
    return LoraTarget(path, "linear", in_features, out_features,
                      {leaf: LoraPieceSpec(*piece) for leaf, piece in pieces.items()}, num_pieces)
